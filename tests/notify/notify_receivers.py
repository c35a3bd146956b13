"""Real HTTP receivers for the notify tests: a threaded http.server on 127.0.0.1 that answers from a script and
records every request it gets (method, path, headers, raw body, arrival time)."""
from __future__ import annotations

import dataclasses
import http.server
import threading
import time


@dataclasses.dataclass
class Received:
    method: str
    path: str
    headers: dict  # lower-case names
    body: bytes
    at: float  # time.monotonic() when the request was read
    status: int  # what the receiver answered


@dataclasses.dataclass
class Reply:
    status: int = 200
    headers: dict = dataclasses.field(default_factory=dict)
    body: bytes = b"ok"
    delay: float = 0.0  # seconds to wait before answering (read timeouts)


class Receiver:
    """``Receiver([Reply(500)] * 5)`` fails five times, then answers ``default`` (200) for ever."""

    def __init__(self, script: list[Reply] | None = None, default: Reply | None = None,
                 protocol: str = "HTTP/1.1"):
        self.script = list(script or [])
        self.default = default or Reply()
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = protocol  # "HTTP/1.0": one request per connection, closed after the answer

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with receiver._lock:
                    reply = receiver.script.pop(0) if receiver.script else receiver.default
                    receiver.requests.append(Received(self.command, self.path,
                                                      {k.lower(): v for k, v in self.headers.items()}, body,
                                                      time.monotonic(), reply.status))
                if reply.delay:
                    time.sleep(reply.delay)
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:
                    pass  # the client gave up (timeout test)

            do_POST = do_GET = do_PUT = _handle

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def bodies(self) -> list[bytes]:
        with self._lock:
            return [r.body for r in self.requests]

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
