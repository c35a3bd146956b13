"""Ingest under sustained overload, at shutdown, and beside a connection flood: one platform process.

    python -m ingest.overload_bench [--overload-seconds 300] [--senders 4] [--paced-seconds 60]
                                         [--connections 2000]

1. Connection flood: `--connections` connections held open (half idle, half sending headers a byte a
   second), then the latency of a normal /readyz, OTLP/HTTP export and API read.
2. Sustained overload: closed-loop senders that retry refused exports (as OTLP exporters do) for
   `--overload-seconds`; the platform's RSS every second (peak, and the slope over the second half),
   the rate of spans accepted once backpressure holds (what the platform sustains), the share refused.
3. SIGTERM at the largest backlog: while the senders still push, the time to exit; then a restart
   drains what was left, and every acknowledged trace is counted once through the summary API.
4. At 80% of the sustained rate, paced, for `--paced-seconds`: refusals (none expected) and the delay
   from an export's arrival to its request rows being queryable (p50, p99, from the platform's
   observatory_ingest_queryable_lag_seconds histogram).
"""
from __future__ import annotations

import argparse
import datetime as dt
import resource
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request

from benchkit.harness import PlatformProcess
from benchkit.load import RssSampler, Senders
from benchkit.payloads import ChainTemplate
from prometheus_client.parser import text_string_to_metric_families


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--overload-seconds", type=float, default=300)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--paced-seconds", type=float, default=60)
    parser.add_argument("--connections", type=int, default=2000)
    args = parser.parse_args(argv)

    platform = PlatformProcess()
    key, token = platform.setup()
    platform.start()
    try:
        flooded = flood(platform, key, token, args.connections)
        sustained, acked = overload(platform, key, args)
        print(f"BENCH overload_acked_traces={len(acked)} traces")
        platform.start()
        platform.wait_idle(600)
        counted = summary_count(platform, token) - flooded
        print(f"BENCH overload_traces_queryable_after_restart={counted} traces")
        if counted != len(acked):
            raise SystemExit(f"{len(acked)} traces acknowledged but {counted} queryable")
        paced(platform, key, 0.8 * sustained, args.paced_seconds)
    finally:
        platform.stop()


def flood(platform: PlatformProcess, key: str, token: str, connections: int) -> int:
    """Returns the number of traces it exported (the same small export, sent again and again)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < connections + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, connections + 1000), hard))
    held = []
    stop = threading.Event()
    for i in range(connections):
        sock = socket.create_connection(("127.0.0.1", platform.port), timeout=10)
        if i % 2:
            sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
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
    calls = {
        "readyz": lambda: platform.get("/readyz"),
        "otlp_http": lambda: platform.post("/v1/traces", payload, {
            "Content-Type": "application/x-protobuf", "Authorization": f"Bearer {key}"}),
        "api": lambda: platform.get(f"/api/v1/requests?trace_id={ids[0]}", token),
    }
    for name, call in calls.items():
        times = []
        for _ in range(20):
            started = time.perf_counter()
            call()
            times.append((time.perf_counter() - started) * 1000)
            time.sleep(0.05)
        times.sort()
        print(f"BENCH http_{name}_with_{connections}_open_p50_ms={times[len(times) // 2]:.1f} ms")
        print(f"BENCH http_{name}_with_{connections}_open_max_ms={times[-1]:.1f} ms")
    stop.set()
    for sock in held:
        sock.close()
    return len(ids)


def overload(platform: PlatformProcess, key: str, args) -> tuple[float, list[str]]:
    rss = RssSampler(platform.proc.pid, interval=1.0).start()
    senders = Senders(platform.port, key, senders=args.senders, retry_delay=0.1).start()
    started = time.monotonic()
    largest = {"backlog_bytes": 0}
    while time.monotonic() - started < args.overload_seconds:
        _, state = platform.get("/readyz")
        if state.get("backlog_bytes", 0) >= largest["backlog_bytes"]:
            largest = state
        time.sleep(1.0)
    ended = time.monotonic()
    sustained = senders.acked_rate(started + args.overload_seconds / 2, ended)
    _, state = platform.get("/readyz")
    signalled = time.monotonic()
    platform.proc.send_signal(signal.SIGTERM)
    code = platform.proc.wait(120)
    took = time.monotonic() - signalled
    senders.stop()
    rss.stop()
    if code != 0:
        raise SystemExit(f"the platform exited {code} on SIGTERM: {platform.log_tail()}")
    total = senders.statuses.get(200, 0) + senders.refusals()
    print(f"BENCH overload_seconds={args.overload_seconds:.0f} s")
    print(f"BENCH overload_rss_peak_mib={rss.peak():.0f} MiB")
    print(f"BENCH overload_rss_slope_second_half_mib_per_min={rss.slope_mib_per_min():.1f} MiB/min")
    print(f"BENCH overload_sustained_spans_per_s={sustained:.0f} spans/s")
    print(f"BENCH overload_refused_share={senders.refusals() / max(total, 1):.3f} ratio")
    print(f"BENCH overload_largest_backlog_mb={largest['backlog_bytes'] / 1e6:.0f} MB")
    print(f"BENCH overload_largest_backlog_oldest_s={largest['backlog_oldest_seconds']:.1f} s")
    print(f"BENCH sigterm_backlog_traces={state['decomposition_pending']} traces")
    print(f"BENCH sigterm_backlog_mb={state['backlog_bytes'] / 1e6:.0f} MB")
    print(f"BENCH sigterm_exit_seconds={took:.1f} s")
    if senders.errors:
        print(f"(after the signal, {len(senders.errors)} sends failed to connect or were cut: "
              f"{sorted(set(e.split('(')[0] for e in senders.errors))})")
    return sustained, senders.acked


def paced(platform: PlatformProcess, key: str, rate: float, seconds: float) -> None:
    before = lag_buckets(platform)
    senders = Senders(platform.port, key, senders=4, spans_per_second=rate, retry_delay=0.1).start()
    time.sleep(seconds)
    senders.stop()
    platform.wait_idle(300)
    after = lag_buckets(platform)
    buckets = [(bound, after[bound] - before.get(bound, 0)) for bound in sorted(after)]
    print(f"BENCH paced80_offered_spans_per_s={rate:.0f} spans/s")
    print(f"BENCH paced80_acked_spans_per_s={senders.acked_spans / seconds:.0f} spans/s")
    print(f"BENCH paced80_refusals={senders.refusals()} exports")
    print(f"BENCH paced80_lag_p50_s={quantile(buckets, 0.5):.2f} s")
    print(f"BENCH paced80_lag_p99_s={quantile(buckets, 0.99):.2f} s")


def lag_buckets(platform: PlatformProcess) -> dict[float, float]:
    with urllib.request.urlopen(platform.url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "observatory_ingest_queryable_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out[float(sample.labels["le"])] = sample.value
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) pairs: linear within a bucket."""
    total = buckets[-1][1]
    if total <= 0:
        return float("nan")
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


def summary_count(platform: PlatformProcess, token: str) -> int:
    now = dt.datetime.now(dt.timezone.utc)
    params = urllib.parse.urlencode({"group_by": "", "since": (now - dt.timedelta(days=1)).isoformat(),
                                     "until": (now + dt.timedelta(hours=1)).isoformat(), "exact": "1"})
    _, body = platform.get(f"/api/v1/latency/summary?{params}", token)
    return sum(group["count"] for group in body["groups"])


if __name__ == "__main__":
    main()
