"""OTLP/HTTP load against a platform process: senders that keep it busy (closed loop, or paced at a span rate)
and retry refused exports as OTLP exporters do, and a sampler of the platform's resident memory.

Used by the overload benchmark (ingest.overload_bench) and the overload tests.
"""
from __future__ import annotations

import collections
import http.client
import threading
import time

from benchkit.payloads import ChainTemplate


class Senders:
    """`senders` threads posting 999-span chain batches to /v1/traces until stop().

    A refused export (503) is sent again after `retry_delay` seconds (exporters honour Retry-After; the
    benchmark and tests retry sooner, to keep the platform at its limit), so every batch ends acked or, at
    stop(), never acked. With `spans_per_second`, sending is paced to that total rate (open loop);
    without, each sender sends its next batch as soon as the last was answered (closed loop)."""

    def __init__(self, port: int, key: str, *, senders: int = 4, spans_per_second: float | None = None,
                 retry_delay: float = 0.2, template: ChainTemplate | None = None, timeout: float = 60):
        self.port = port
        self.key = key
        self.senders = senders
        self.spans_per_second = spans_per_second
        self.retry_delay = retry_delay
        self.template = template or ChainTemplate()
        self.timeout = timeout
        self.acked: list[str] = []  # trace ids, in ack order
        self.acked_spans = 0
        self.unacked: list[str] = []  # trace ids of batches still refused at stop()
        self.statuses: collections.Counter = collections.Counter()
        self.errors: list[str] = []  # transport failures (no HTTP answer)
        self.timeline: list[tuple[float, int, int]] = []  # (monotonic, spans acked so far, refusals so far)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next_send = 0.0

    def start(self) -> Senders:
        self._next_send = time.monotonic()
        for i in range(self.senders):
            thread = threading.Thread(target=self._run, name=f"sender-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = 120) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def _pace(self, spans: int) -> None:
        if not self.spans_per_second:
            return
        with self._lock:
            at = self._next_send
            self._next_send = max(at, time.monotonic()) + spans / self.spans_per_second
        delay = at - time.monotonic()
        if delay > 0:
            self._stop.wait(delay)

    def _run(self) -> None:
        conn = None
        headers = {"Content-Type": "application/x-protobuf", "Authorization": f"Bearer {self.key}"}
        while not self._stop.is_set():
            body, ids = self.template.batch()
            spans = 3 * len(ids)
            self._pace(spans)
            while True:
                if self._stop.is_set():
                    with self._lock:
                        self.unacked.extend(ids)
                    break
                try:
                    if conn is None:
                        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                    conn.request("POST", "/v1/traces", body=body, headers=headers)
                    response = conn.getresponse()
                    response.read()
                    status = response.status
                    if response.getheader("connection", "").lower() == "close":
                        conn.close()
                        conn = None
                except (OSError, http.client.HTTPException) as exc:
                    if conn is not None:
                        conn.close()
                    conn = None
                    with self._lock:
                        self.errors.append(repr(exc))
                    self._stop.wait(self.retry_delay)
                    continue
                with self._lock:
                    self.statuses[status] += 1
                    if status == 200:
                        self.acked.extend(ids)
                        self.acked_spans += spans
                    self.timeline.append((time.monotonic(), self.acked_spans, self.refusals()))
                if status == 200:
                    break
                if status != 503:
                    with self._lock:
                        self.errors.append(f"HTTP {status}")
                    break
                self._stop.wait(self.retry_delay)
        if conn is not None:
            conn.close()

    def refusals(self) -> int:
        return self.statuses.get(503, 0)

    def acked_rate(self, since: float, until: float) -> float:
        """Spans acked per second between two monotonic times (from the timeline)."""
        with self._lock:
            points = list(self.timeline)
        before = [p for p in points if p[0] <= since]
        upto = [p for p in points if p[0] <= until]
        start = before[-1][1] if before else 0
        end = upto[-1][1] if upto else 0
        return (end - start) / max(until - since, 1e-9)


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (VmRSS), Linux only."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class RssSampler:
    """Samples a process's RSS every `interval` seconds: (seconds since start, MiB)."""

    def __init__(self, pid: int, interval: float = 1.0):
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self) -> RssSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = rss_mib(self.pid)
            if value is not None:
                self.samples.append((time.monotonic() - self._started, value))
            self._stop.wait(self.interval)

    def peak(self) -> float:
        return max(v for _, v in self.samples)

    def slope_mib_per_min(self, since_fraction: float = 0.5) -> float:
        """Slope of RSS over the samples after `since_fraction` of the run, MiB per minute: the Theil-Sen estimate
        (the median of the slopes between pairs of samples), which one spike near the end does not tilt the way it
        tilts a least-squares line (RSS wobbles by ±100 MiB around its level under load)."""
        if not self.samples:
            return 0.0
        end = self.samples[-1][0]
        points = [(t, v) for t, v in self.samples if t >= end * since_fraction]
        if len(points) < 2 or points[-1][0] == points[0][0]:
            return 0.0
        from scipy.stats import theilslopes

        slope = theilslopes([v for _, v in points], [t for t, _ in points]).slope
        return 60 * float(slope)
