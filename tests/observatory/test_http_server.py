"""The web port's HTTP server (observatory/http_server.py) on its own, with a small WSGI app: slow and silent
clients are cut off by the header and body timeouts, oversized headers and bodies are refused, bodies reach
the app whole (chunked ones with their length), the connection limit answers 503, and a shutdown drains:
requests being handled finish, a body still arriving gets 503 with Retry-After, not a reset."""
from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest
from observatory.http_server import HttpServer


def echo_app(environ, start_response):
    """Answers with the body's length, the Content-Length the app saw, and the path; /slow sleeps first."""
    body = environ["wsgi.input"].read()
    if environ["PATH_INFO"] == "/slow":
        time.sleep(float(environ.get("QUERY_STRING") or 1))
    text = f"{len(body)} {environ.get('CONTENT_LENGTH', '-')} {environ['PATH_INFO']}".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(text)))])
    return [text]


class Running:
    def __init__(self, **options):
        settings = dict(threads=4, max_connections=1000, header_timeout=1.0, keepalive_timeout=5.0,
                        body_timeout=2.0, max_body_bytes=1 << 20, drain_seconds=1.0, max_header_bytes=8 * 1024)
        settings.update(options)
        self.server = HttpServer(echo_app, "127.0.0.1:0", **settings)
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        self.server.begin_shutdown()
        self.thread.join(20)


@pytest.fixture
def server():
    running = Running()
    yield running
    running.stop()


def raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """Everything the server sent until it closed. A reset is a failure unless the whole answer (headers and
    Content-Length bytes of body) had arrived first: a client that keeps sending after it was answered may be
    reset at the close, but it has its answer."""
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            received = b"".join(chunks)
            if not _complete(received):
                raise AssertionError(f"connection reset before a whole answer: {received!r}") from None
            return received
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def _complete(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return bool(length) and len(body) >= length[0]


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("POST", path, body=body, headers=headers or {})
    response = conn.getresponse()
    result = response.status, response.read()
    conn.close()
    return result


def test_a_request_reaches_the_app_with_its_whole_body(server):
    assert post(server.port, "/x", b"a" * 300_000) == (200, b"300000 300000 /x")


def test_a_chunked_body_reaches_the_app_whole_with_its_length(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    conn.request("POST", "/chunked", body=iter([b"abc", b"defgh", b"i" * 70_000]), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"70008 70008 /chunked")


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server):
    sock = raw(server.port)
    started = time.monotonic()
    assert read_response(sock) == b""  # closed, no request to answer
    assert 0.8 < time.monotonic() - started < 5


def test_headers_that_trickle_in_get_408_at_the_header_timeout(server):
    sock = raw(server.port)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    stop = threading.Event()

    def trickle():  # a byte every 0.2 s: activity, but the headers never end
        while not stop.is_set():
            try:
                sock.send(b"X")
            except OSError:
                return
            time.sleep(0.2)

    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    answer = read_response(sock)
    stop.set()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < 5


def test_oversized_headers_get_431(server):
    sock = raw(server.port)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
    assert read_response(sock).startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize("pace", ["flood", "trickle"])
def test_a_client_still_sending_after_a_431_reads_it_and_is_closed_within_the_linger(server, pace):
    """The answer and the server's FIN come at once; what the client sends afterwards is dropped for a bounded
    time (2 s) or number of bytes, then the connection closes: a client that never stops cannot keep it."""
    sock = raw(server.port)
    sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * 100_000)
    stop = threading.Event()
    cut_off = threading.Event()

    def keep_sending():
        while not stop.is_set():
            try:
                sock.send(b"a" * 65536 if pace == "flood" else b"a")
            except OSError:
                cut_off.set()
                return
            if pace == "trickle":
                time.sleep(0.05)

    threading.Thread(target=keep_sending, daemon=True).start()
    started = time.monotonic()
    head = b""
    while b"\r\n\r\n" not in head or not _complete(head):
        data = sock.recv(65536)
        assert data, head
        head += data
    assert head.startswith(b"HTTP/1.1 431") and head.endswith(b"\r\n\r\nRequest Header Fields Too Large\n")
    assert sock.recv(10) == b""  # FIN right after the answer
    assert time.monotonic() - started < 1
    assert cut_off.wait(6), "the server never closed a connection that kept sending"
    stop.set()
    sock.close()
    assert post(server.port, "/x", b"ok") == (200, b"2 2 /x")


def test_a_body_that_arrives_too_slowly_gets_408(server):
    sock = raw(server.port)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
    started = time.monotonic()
    assert read_response(sock).startswith(b"HTTP/1.1 408")
    assert 1.5 < time.monotonic() - started < 6


def test_a_body_announced_or_found_too_large_gets_413(server):
    sock = raw(server.port)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n")
    assert read_response(sock).startswith(b"HTTP/1.1 413")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    conn.request("POST", "/", body=iter([b"a" * 600_000, b"a" * 600_000]), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})
    assert conn.getresponse().status == 413


def test_keep_alive_serves_several_requests_and_idle_connections_close_after_the_timeout():
    running = Running(keepalive_timeout=1.0)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=20)
        for i in range(3):
            conn.request("POST", f"/{i}", body=b"x")
            assert conn.getresponse().read() == f"1 1 /{i}".encode()
        sock = conn.sock
        time.sleep(2.0)
        assert sock.recv(10) == b""  # closed by the server
    finally:
        running.stop()


def test_beyond_the_connection_limit_requests_get_503():
    running = Running(max_connections=5, header_timeout=30)
    try:
        idle = [raw(running.port) for _ in range(6)]
        time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=20)
        conn.request("GET", "/")
        assert conn.getresponse().status == 503
        for sock in idle:
            sock.close()
    finally:
        running.stop()


def test_shutdown_answers_what_is_in_flight_and_stops_listening():
    running = Running(drain_seconds=1.0)
    results = {}

    def slow_request():  # being handled when the shutdown starts: finishes with 200
        results["slow"] = post(running.port, "/slow", b"", {"Content-Length": "0"})

    handled = threading.Thread(target=slow_request)
    handled.start()
    # A body still arriving at the drain deadline: 503 with Retry-After, read before the close (no reset).
    uploading = raw(running.port)
    uploading.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"a" * 1000)
    # A body that completes during the drain: handled normally.
    finishing = raw(running.port)
    finishing.sendall(b"POST /late HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n" + b"a" * 10)
    time.sleep(0.3)
    started = time.monotonic()
    running.server.begin_shutdown()
    time.sleep(0.3)
    finishing.sendall(b"a" * 10)
    stop = threading.Event()

    def keep_uploading():  # slower than the drain allows, but still sending: must not be reset
        while not stop.is_set():
            try:
                uploading.send(b"a" * 100)
            except OSError:
                return
            time.sleep(0.05)

    threading.Thread(target=keep_uploading, daemon=True).start()
    assert read_response(finishing).startswith(b"HTTP/1.1 200")
    answer = read_response(uploading)
    stop.set()
    assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 5" in answer.lower(), answer
    handled.join(10)
    assert results["slow"][0] == 200
    running.thread.join(20)
    assert time.monotonic() - started < 8
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", running.port), timeout=2)
