"""Headers beyond OBSERVATORY_HTTP_MAX_HEADER_BYTES (64 KiB) on a live platform's web port: the client reads a
431 with its short body, then the connection closes, and the port keeps serving (issue 38). One header or many
small ones, 70 KB to 1 MB, on OTLP/HTTP and on the API, each sent whole by http.client before it reads, as an
exporter does. Before the fix the server closed the socket with the rest of the headers unread, and the
kernel's reset took the answer with it.

The limit is the web server's, before Django: nothing here depends on the mode, so CI runs it in one suite."""
from __future__ import annotations

import http.client

import pytest

pytestmark = pytest.mark.one_suite(suite="embedded")

SIZES = [70_000, 200_000, 1_000_000]
ANSWER = b"Request Header Fields Too Large\n"


def oversized_headers(shape: str, size: int, authorization: str) -> dict[str, str]:
    if shape == "one":  # a token pasted wrong, a proxy's runaway header
        return {"Authorization": authorization + " " + "a" * size}
    headers = {"Authorization": authorization}
    headers.update({f"X-Baggage-{i}": "b" * 86 for i in range(size // 100)})  # ~100 bytes a line
    return headers


def exchange(platform, method: str, path: str, headers: dict[str, str], body: bytes | None = None):
    """(status, body, Connection header, whether the server closed after it) as a real client reads them."""
    conn = http.client.HTTPConnection("127.0.0.1", platform.process.port, timeout=30)
    conn.connect()
    probe = conn.sock.dup()  # http.client lets go of its socket after "Connection: close"; this one stays
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        closed = response.will_close and probe.recv(1) == b""
        return response.status, data, response.getheader("Connection"), closed
    finally:
        probe.close()
        conn.close()


def normal_request(platform, route: str) -> int:
    if route == "otlp":
        return exchange(platform, "POST", "/v1/traces", {
            "Content-Type": "application/x-protobuf", "Authorization": f"Bearer {platform.keys['alpha']}"}, b"")[0]
    return exchange(platform, "GET", "/api/v1/slos", {"Authorization": f"Bearer {platform.tokens['alice']}"})[0]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("shape", ["one", "many"])
@pytest.mark.parametrize("route", ["otlp", "api"])
def test_oversized_headers_are_answered_431_then_the_port_keeps_serving(live_platform, route, shape, size):
    if route == "otlp":
        method, path, body = "POST", "/v1/traces", b"\x0a\x00" * 500  # a small export follows the headers
        headers = oversized_headers(shape, size, f"Bearer {live_platform.keys['alpha']}")
        headers["Content-Type"] = "application/x-protobuf"
    else:
        method, path, body = "GET", "/api/v1/slos", None
        headers = oversized_headers(shape, size, f"Bearer {live_platform.tokens['alice']}")
    status, data, connection, closed = exchange(live_platform, method, path, headers, body)
    assert (status, data) == (431, ANSWER)
    assert connection == "close" and closed
    assert normal_request(live_platform, route) == 200
