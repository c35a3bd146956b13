"""The web port of a live platform: thousands of idle or slow connections do not close it to the API, OTLP/HTTP
and /readyz, and every export in flight when SIGTERM arrives gets an HTTP answer (200 once durable, or 503
with Retry-After), not a reset."""
from __future__ import annotations

import http.client
import resource
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from benchkit.payloads import ChainTemplate
from otlp_live_helpers import assert_stored_exactly_once, readyz


@pytest.fixture(scope="module")
def enough_files():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 10_000) if hard != resource.RLIM_INFINITY else 10_000
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if wanted < 4500:
        pytest.skip(f"this process may open only {wanted} files; the test needs ~4,100")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_two_thousand_idle_or_slow_connections_leave_the_port_answering(tmp_path, platform_process, enough_files):
    platform = platform_process(data_dir=str(tmp_path / "data"))
    key, token = platform.setup()
    platform.start()
    held: list[socket.socket] = []
    stop = threading.Event()
    try:
        for i in range(2000):
            sock = socket.create_connection(("127.0.0.1", platform.port), timeout=10)
            if i % 2:  # slow: headers begun, a byte now and then (within the header timeout)
                sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(sock)

        def trickle():
            while not stop.wait(1.0):
                for sock in held[1::2]:
                    try:
                        sock.send(b"a")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(1.0)
        payload, ids = ChainTemplate(traces=20).batch()

        def export():
            status, _, _ = platform.post("/v1/traces", payload, {
                "Content-Type": "application/x-protobuf", "Authorization": f"Bearer {key}"})
            assert status == 200

        def api():
            status, body = platform.get(f"/api/v1/requests?trace_id={ids[0]}", token)
            assert status == 200, body

        def ready():
            assert platform.get("/readyz")[0] == 200

        for name, call in (("/readyz", ready), ("OTLP/HTTP", export), ("API", api)):
            worst = max(timed(call) for _ in range(5))
            assert worst < 1.0, f"{name} took {worst:.2f}s with 2,000 connections open"
        # The slow ones are cut off at the header timeout (10 s), the idle ones too: the port frees itself.
        time.sleep(11)
        closed = 0
        for sock in held:
            sock.settimeout(0.5)
            try:
                data = sock.recv(1024)
                closed += data == b"" or data.startswith(b"HTTP/1.1 408")
            except (TimeoutError, OSError):
                pass
        assert closed >= 1900, f"only {closed} of 2,000 held connections were closed by the server"
    finally:
        stop.set()
        for sock in held:
            sock.close()
        platform.stop()


def test_every_export_in_flight_at_sigterm_gets_an_answer(tmp_path, platform_process):
    platform = platform_process(data_dir=str(tmp_path / "data"))
    key, _ = platform.setup()
    platform.start()
    template = ChainTemplate(traces=333)
    signal_at: list[float] = []
    outcomes: list[tuple[float, str, list[str]]] = []  # (first byte sent, outcome, trace ids)
    lock = threading.Lock()

    def client(upload: float):
        """Exports of ~500 KB sent in 32 KiB pieces over `upload` seconds, on one kept-alive connection."""
        sock = None
        while not signal_at or time.monotonic() < signal_at[0] + 1:
            body, ids = template.batch()
            pace = upload / -(-len(body) // 32768)
            head = (f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
                    f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", platform.port), timeout=30)
            except OSError:
                return  # the listener is gone: nothing in flight
            began = time.monotonic()
            outcome = "unanswered"
            try:
                sock.sendall(head)
                for at in range(0, len(body), 32768):
                    sock.sendall(body[at:at + 32768])
                    time.sleep(pace)
                response = http.client.HTTPResponse(sock)
                response.begin()
                response.read()
                outcome = str(response.status)
                if response.status == 503:
                    outcome += f" retry-after={response.getheader('retry-after')}"
                if response.will_close:
                    sock.close()
                    sock = None
            except (OSError, http.client.HTTPException) as exc:
                outcome = f"error {exc!r}"
                sock.close()
                sock = None
            with lock:
                outcomes.append((began, outcome, ids))

    # The slowest client's first export (begun ~3 s before the signal) is still arriving at the drain deadline
    # (signal + 4 s) and ends before the server stops reading it (2 s later): it must read a 503, not a reset.
    # Its length is set in seconds, not per piece: a batch a few attributes longer once pushed a per-piece pace
    # past the linger.
    threads = [threading.Thread(target=client, args=(upload,)) for upload in (0.0, 0.0, 0.16, 0.8, 3.2, 8.0)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    signal_at.append(time.monotonic())
    platform.proc.send_signal(signal.SIGTERM)
    code = platform.proc.wait(30)
    for thread in threads:
        thread.join(30)
    assert code == 0, platform.log_tail()
    # Begun before the signal: in flight. Each got an HTTP answer: 200, or 503 with a retry delay for a
    # body still arriving at the drain deadline (the slowest client's first).
    in_flight = [(outcome, ids) for began, outcome, ids in outcomes if began < signal_at[0]]
    assert in_flight and all(o == "200" or o == "503 retry-after=5" for o, _ in in_flight), \
        [(round(began - signal_at[0], 3), outcome) for began, outcome, _ in outcomes if outcome != "200"]
    assert any(o == "200" for o, _ in in_flight)
    acked = [t for began, outcome, ids in outcomes if outcome == "200" for t in ids]
    platform.start()
    try:
        platform.wait_idle(120)
        assert readyz(platform)["backlog_bytes"] == 0
    finally:
        platform.stop(cleanup=False)
    assert_stored_exactly_once(str(Path(platform.data_dir) / "chdb"), acked)
