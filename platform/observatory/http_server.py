"""The web port's HTTP server: uvicorn's event loop holds the connections, Django runs on a thread pool.

Connections (idle, slow, keep-alive) cost an asyncio protocol object each, not a thread, and nothing
scans them all: uvicorn with httptools, handing each request to Django's WSGI application on a bounded thread
pool (OBSERVATORY_HTTP_THREADS) once its body is complete (WsgiOnThreads). Around it:

- a header-read timeout (OBSERVATORY_HTTP_HEADER_TIMEOUT_SECONDS) from a connection's first byte, or
  from its opening when nothing comes, to the end of the request headers, and a bound on header
  bytes (431 beyond it): a slow or silent client cannot hold a connection for long; the 408 or 431
  is followed by a lingering close, so that a client still sending reads it instead of a reset;
- an idle keep-alive timeout (OBSERVATORY_HTTP_KEEPALIVE_SECONDS) between requests;
- whole bodies before Django: a request reaches the thread pool only once its body has arrived (at
  most OBSERVATORY_HTTP_MAX_BODY_BYTES, within OBSERVATORY_HTTP_BODY_TIMEOUT_SECONDS; 413 / 408
  otherwise), so slow uploads wait in the event loop and never hold one of the few threads, as
  waitress did by buffering;
- a connection limit far above the thread count (OBSERVATORY_HTTP_MAX_CONNECTIONS, 503 beyond it),
  with the process's open-file limit raised to fit it.

Why not waitress, the server until this change: its one I/O thread rebuilds its poll set from every
connection on each turn of its loop, and it has no header-read timeout. Measured on the 2-core
machine with a trivial WSGI app and 2,000 open connections (docs/ingest.md, "HTTP server limits"): waitress
(asyncore poll, connection_limit 10,000) answered a normal request in 13 ms p50 and up to 440 ms,
uvicorn in 2.3 ms p50 and 11 ms at most; with its default limit of 200 connections waitress stopped
answering at all.

Shutdown (`begin_shutdown`, from the signal handler): the listening socket closes, idle connections
close, requests being handled finish, and a body still arriving gets until the drain deadline
(OBSERVATORY_SHUTDOWN_DRAIN_SECONDS) to arrive, then 503 with Retry-After: every export in flight
gets an answer instead of a reset.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import resource
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


def raise_open_files_limit(wanted: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards `wanted` (never above the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a platform that refuses: keep what we have
            log.warning("could not raise the open-files limit from %d to %d", soft, target)
    return soft


class _Refused(Exception):
    """Raised in a parser callback that has answered 408/431: stops the parser at once."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header-read timeout, a bound on header bytes, and bodies handed
    to the application in one piece.

    One piece: uvicorn passes a body on as it arrives, pausing the socket every 64 KiB until the
    application asks for more. Each of those steps is a turn of the event loop, and under ingest's
    load every turn first waits for the GIL (up to the 5 ms switch interval): a 1 MB export took ~8
    turns. Here reads are 1 MiB, the parts are kept until the body is complete (WholeBodies reads it
    all anyway; it enforces the size bound, reading stops beyond 4 MiB pending), and the application
    is woken once."""

    header_timeout = 10.0  # set per server (a subclass is made in HttpServer)
    max_header_bytes = 64 * 1024
    read_size = 1 << 20
    max_pending_body = 4 << 20
    idle_close_grace = 1.0  # at shutdown, an idle kept-alive connection closes after this (see shutdown())
    # After a refusal, what the client still sends is read and dropped for this long, up to this many bytes
    # (set per server: the largest request it would accept), before the close (see _reject).
    linger_seconds = 2.0
    linger_bytes = 20 << 20

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # asyncio's selector transport reads max_size bytes per turn (256 KiB by default).
        if hasattr(transport, "max_size"):
            transport.max_size = self.read_size
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._body_parts: list[bytes] = []
        self._body_pending = 0
        self._shutting_down = False
        self._header_bytes = 0  # bytes received since the last request's headers ended, outside bodies
        self._in_headers = False
        self._in_body = False
        self._refused = False  # answered 408/431: the rest is read and dropped until the close
        self._linger_left = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        # Nothing sent yet: the header clock runs from the opening.
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout)

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self.transport.close()
            return
        if self.transport.is_closing():
            return
        if not self._in_body:
            self._header_bytes += len(data)
        # uvicorn's data_received, but a callback that refused the request stops the parser without the 400
        # uvicorn sends for a parse error.
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refused:
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        # Headers still incomplete: all that was received since they began is theirs.
        if self._in_headers and self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._reject(431, b"Request Header Fields Too Large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_size = 0
        if self._header_timer is None:  # a new request on a kept-alive connection
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout)

    def on_url(self, url: bytes) -> None:
        self._header_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_size += len(name) + len(value) + 4
        if self._header_size > self.max_header_bytes:  # many arrived within one read: stop parsing them now
            self._reject(431, b"Request Header Fields Too Large")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._in_body = True
        self._header_bytes = 0
        self._cancel_header_timer()
        if self._header_size > self.max_header_bytes:  # they arrived within one read
            self._reject(431, b"Request Header Fields Too Large")
            raise _Refused
        super().on_headers_complete()
        if self._shutting_down and self.cycle is not None:
            self.cycle.keep_alive = False  # answered, then closed

    def shutdown(self) -> None:
        """The server is stopping. uvicorn closes an idle kept-alive connection at once; a request its client
        sent just then (exporters send the next batch right after an answer) would meet a reset. Here the
        connection stays open `idle_close_grace` seconds: a request arriving meanwhile is handled and
        answered with Connection: close, and an idle connection then closes."""
        self._shutting_down = True
        if self.cycle is None or self.cycle.response_complete:
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.idle_close_grace, self.timeout_keep_alive_handler)
        else:
            self.cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or cycle.response_complete or (
                self.parser.should_upgrade() and self._should_upgrade()):
            return
        self._body_parts.append(body)
        self._body_pending += len(body)
        if self._body_pending >= self.max_pending_body:
            self._hand_over_body()
            self.flow.pause_reading()  # resumed by uvicorn when the application takes it

    def on_message_complete(self) -> None:
        self._in_body = False
        if self.transport.is_closing() or self.cycle is None:
            return
        if self._body_parts:
            self._hand_over_body()
        super().on_message_complete()

    def _hand_over_body(self) -> None:
        cycle = self.cycle
        parts = self._body_parts
        cycle.body = cycle.body + b"".join(parts) if cycle.body else (parts[0] if len(parts) == 1 else b"".join(parts))
        self._body_parts = []
        self._body_pending = 0
        cycle.message_event.set()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._in_headers:
            self._reject(408, b"Request Timeout")
        elif self.cycle is None or self.cycle.response_complete:
            self.transport.close()  # opened and never used

    def _reject(self, status: int, reason: bytes) -> None:
        """Answer, then a lingering close, as Apache and nginx do. The client is usually still sending (the
        rest of a 200 KB header, its body); a socket closed with unread data sends a reset, and the client's
        send fails or its kernel drops the answer not read yet: the exporter logs a reset and retries. So:
        the answer, then FIN (write_eof), and what still comes is read and dropped until the client closes,
        `linger_bytes` have come or `linger_seconds` have passed."""
        self._cancel_header_timer()
        self._refused = True
        if self.cycle is not None and not self.cycle.response_complete:
            # A request pipelined behind one still being answered: its answer cannot go first.
            self.transport.close()
            return
        body = reason + b"\n"
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.transport.resume_reading()
        self._linger_left = self.linger_bytes
        self._linger_timer = self.loop.call_later(self.linger_seconds, self.transport.close)


async def _answer(send, status: int, text: str, *, retry_after: int | None = None, receive=None,
                  linger: float = 2.0) -> None:
    """A plain-text answer, then the connection closes. With `receive` (a request whose body is still
    arriving), the rest of the body is read and dropped for up to `linger` seconds before the close: a
    socket closed with unread data sends a reset, and the client may lose the answer it has not read yet."""
    body = (text + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if receive is None:
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    # The whole answer now; the empty end (which closes the connection) once the client stops sending.
    await send({"type": "http.response.body", "body": body, "more_body": True})
    try:
        async with asyncio.timeout(linger):
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
    except TimeoutError:
        pass
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class WholeBodies:
    """ASGI middleware: read each request's whole body in the event loop, then hand it to `app` in one
    piece, with its Content-Length set (chunked uploads too, as WSGI applications expect)."""

    def __init__(self, app, *, max_body_bytes: int, body_timeout: float, retry_after: int = 5):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.retry_after = retry_after
        self.drain_deadline: float | None = None  # loop time; set when shutting down
        self._reading: set[asyncio.Timeout] = set()

    def drain(self, seconds: float) -> None:
        """Shutting down: bodies still arriving get at most `seconds` more (call in the event loop)."""
        when = asyncio.get_running_loop().time() + seconds
        self.drain_deadline = when
        for timeout in list(self._reading):
            current = timeout.when()
            if current is None or current > when:
                timeout.reschedule(when)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        length = None
        chunked = False
        for name, value in headers:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if length is not None and not chunked:
            # httptools has checked the syntax; a body announced too large is refused before reading it.
            try:
                announced = int(length)
            except ValueError:
                return await _answer(send, 400, "invalid Content-Length")
            if announced > self.max_body_bytes:
                return await _answer(send, 413, f"request body exceeds {self.max_body_bytes} bytes", receive=receive)
            if announced == 0:
                return await self.app(scope, receive, send)
        elif not chunked:
            return await self.app(scope, receive, send)  # no body
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        if self.drain_deadline is not None:
            deadline = min(deadline, self.drain_deadline)
        parts = []
        size = 0
        try:
            async with asyncio.timeout_at(deadline) as timeout:
                self._reading.add(timeout)
                try:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            return
                        part = message.get("body", b"")
                        size += len(part)
                        if size > self.max_body_bytes:
                            return await _answer(send, 413, f"request body exceeds {self.max_body_bytes} bytes",
                                                 receive=receive)
                        parts.append(part)
                        if not message.get("more_body", False):
                            break
                finally:
                    self._reading.discard(timeout)
        except TimeoutError:
            if self.drain_deadline is not None and loop.time() >= self.drain_deadline - 0.01:
                return await _answer(send, 503, "shutting down; retry", retry_after=self.retry_after,
                                     receive=receive)
            return await _answer(send, 408, "request body not received in time", receive=receive)
        body = b"".join(parts)
        if chunked:
            scope = dict(scope)
            scope["headers"] = [(n, v) for n, v in headers if n not in (b"transfer-encoding", b"content-length")]
            scope["headers"].append((b"content-length", str(len(body)).encode()))
        delivered = False

        async def whole_body():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, whole_body, send)


class WsgiOnThreads:
    """ASGI → WSGI for requests whose body is complete (WholeBodies): the WSGI application runs on a
    thread of a bounded pool with the body in memory, its whole response is collected there, and the
    event loop sends it. One hand-off to the pool and one back per request.

    Why not a2wsgi, which does the same in general: it streams the body and the response, one
    hand-off between threads per message, and copies the body as it reads it. With 1 MB exports and
    ingest's threads holding the GIL, each hand-off waits for the GIL: measured with a WSGI app that
    spends 8 ms per request under a lock beside a thread busy half the time (ingest's pattern), 2
    closed-loop clients: 43 requests/s and 23 ms of CPU per request through a2wsgi, 57 and 17.5
    through this class, 57 and 17.6 through waitress. Our responses are small JSON or protobuf
    documents, so nothing is lost by not streaming them."""

    def __init__(self, app, *, threads: int):
        self.app = app
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return  # no websockets, lifespan is off
        message = await receive()
        body = message.get("body", b"") if message["type"] == "http.request" else b""
        environ = wsgi_environ(scope, body)
        loop = asyncio.get_running_loop()
        status, headers, content = await loop.run_in_executor(self.executor, self._run, environ)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content, "more_body": False})

    def _run(self, environ: dict) -> tuple[int, list, bytes]:
        started: list = []
        chunks: list[bytes] = []

        def start_response(status, response_headers, exc_info=None):
            if exc_info is not None and started:
                raise exc_info[1].with_traceback(exc_info[2])
            started[:] = [status, response_headers]
            return chunks.append

        try:
            result = self.app(environ, start_response)
            try:
                for chunk in result:
                    if chunk:
                        chunks.append(chunk)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
        except Exception:
            log.exception("error in the WSGI application for %s %s", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            return 500, [(b"content-type", b"text/plain; charset=utf-8")], b"Internal Server Error\n"
        finally:
            # Django's request objects sit in reference cycles (request, session, messages) that wait for
            # the cyclic GC, whose full collections are rare in this process (serve.tune_gc). Closing the
            # input frees the body now (~1 MB an export) instead of with the request: 775 bodies, ~390 MB,
            # were waiting so under sustained ingest.
            environ["wsgi.input"].close()
        status, response_headers = started
        headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in response_headers]
        return int(status.split(" ", 1)[0]), headers, b"".join(chunks)


def wsgi_environ(scope: dict, body: bytes) -> dict:
    """The PEP 3333 environ of an ASGI HTTP request with its whole body."""
    server = scope.get("server") or ("localhost", 80)
    environ = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": "",
        # PEP 3333: the decoded path as "bytes in a str" (latin-1), as Django expects it.
        "PATH_INFO": scope["path"].encode("utf-8").decode("latin-1"),
        "QUERY_STRING": scope["query_string"].decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1] or 0),
        "SERVER_PROTOCOL": f"HTTP/{scope['http_version']}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    client = scope.get("client")
    if client is not None:
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = client[0], str(client[1])
    for name, value in scope["headers"]:
        key = name.decode("latin-1").upper().replace("-", "_")
        if key not in ("CONTENT_LENGTH", "CONTENT_TYPE"):
            key = "HTTP_" + key
        value = value.decode("latin-1")
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    if body and "CONTENT_LENGTH" not in environ:
        environ["CONTENT_LENGTH"] = str(len(body))
    return environ


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling (runplatform installs it) and a drain before shutdown."""

    def __init__(self, config: uvicorn.Config, bodies: WholeBodies, drain_seconds: float):
        super().__init__(config)
        self.bodies = bodies
        self.drain_seconds = drain_seconds
        self.on_shutdown_started = None  # called (in the loop, must not block) as the drain begins

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def shutdown(self, sockets=None) -> None:
        self.bodies.drain(self.drain_seconds)
        if self.on_shutdown_started is not None:
            self.on_shutdown_started()
        await super().shutdown(sockets=sockets)


class HttpServer:
    def __init__(self, wsgi_app, bind: str, *, threads: int, max_connections: int, header_timeout: float,
                 keepalive_timeout: float, body_timeout: float, max_body_bytes: int, drain_seconds: float,
                 max_header_bytes: int = 64 * 1024, retry_after: int = 5):
        host, _, port = bind.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        raise_open_files_limit(max_connections + 1024)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
        # a response's header and body writes wait ~40 ms for the client's delayed ACK (Nagle).
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, int(port)))
        except OSError:
            self.sock.close()
            raise
        self.sock.listen(2048)
        self.sock.set_inheritable(False)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.wsgi = WsgiOnThreads(wsgi_app, threads=threads)
        self.bodies = WholeBodies(self.wsgi, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                                  retry_after=retry_after)
        protocol = type("PlatformHttpProtocol", (GuardedHttpToolsProtocol,),
                        {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes,
                         "linger_bytes": max_header_bytes + max_body_bytes})
        config = uvicorn.Config(
            self.bodies,
            http=protocol,
            loop="asyncio",
            lifespan="off",
            interface="asgi3",
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            limit_concurrency=max_connections,
            timeout_keep_alive=keepalive_timeout,
            # Requests being handled get this long after the drain; then uvicorn cancels what is left.
            timeout_graceful_shutdown=drain_seconds + 3,
            backlog=2048,
        )
        self.server = _Server(config, self.bodies, drain_seconds)
        self.stopped_at: float | None = None

    def serve(self) -> None:
        """Serve in this (the main) thread until begin_shutdown(); returns once every request has ended."""
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        finally:
            self.stopped_at = time.monotonic()
            self.wsgi.executor.shutdown(wait=False, cancel_futures=True)

    def begin_shutdown(self) -> None:
        """Safe from a signal handler: uvicorn's loop sees it within 0.1 s."""
        self.server.should_exit = True
