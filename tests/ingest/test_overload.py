"""Ingest under sustained overload and at shutdown, against real platform processes (reduced scale; the
full-scale figures are `python -m ingest.overload_bench`).

- Closed-loop senders that retry refused exports keep the platform beyond what it digests: memory stays
  flat once the bounds are reached, ingest answers 503 once the backlog bound is reached, and every
  acknowledged span is stored exactly once (and nothing else is).
- SIGTERM while a large backlog waits, ten times over on one data directory, with exports still arriving:
  each exit is clean (status 0) within the shutdown bound, each restart queues again what the last process
  left undecomposed, and in the end every acknowledged span is stored exactly once.
"""
from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import numpy
import pytest
from benchkit.harness import PlatformProcess
from benchkit.load import RssSampler, Senders
from otlp_live_helpers import assert_stored_exactly_once, metric_value, metrics_text, readyz, wait_for

# Mode-independent (backpressure of the OTLP receiver; the database only looks the key up): CI runs each test
# once, in the server suite unless it says otherwise (tests/conftest.py).
pytestmark = pytest.mark.mode_independent(suite="server")

SMALL_BOUNDS = {
    "INGEST_BACKLOG_MAX_BYTES": str(24_000_000),
    "INGEST_BACKLOG_MAX_SECONDS": "10",
    "INGEST_DECOMPOSE_MAX_PENDING_TRACES": "8000",
    "INGEST_DECOMPOSE_CHUNK_TRACES": "2000",
    "INGEST_SPOOL_CACHE_BYTES": str(32_000_000),
}
CRASH_SIGNS = ("Traceback", "Segmentation", "global_context->shutdown", "has been closed", "Fatal Python error")


def floor_growth_mib_per_min(samples: list[tuple[float, float]], since: float, window: float = 20) -> float:
    """How fast the floor of RSS rose after `since` seconds, MiB per minute: the 10th percentile of the samples in
    the first and in the last `window` seconds of that span, and the change between them. RSS swings by 100-250 MiB
    within ~15 s as inserts and chunks allocate and free (a slope over the raw samples followed the swings: one
    late peak tilted it); memory that is kept raises the troughs too, window after window."""
    end = samples[-1][0]

    def floor(start: float) -> float:
        return float(numpy.percentile([mib for t, mib in samples if start <= t < start + window], 10))

    return (floor(end - window) - floor(since)) / (end - window - since) * 60


def started(platform: PlatformProcess, timeout: float = 120) -> PlatformProcess:
    platform.start(timeout=timeout)
    return platform


# In the embedded suite: it balances the two suites CI runs side by side.
@pytest.mark.mode_independent(suite="embedded")
def test_sustained_overload_keeps_memory_flat_pushes_back_and_stores_every_acked_span_once(tmp_path, platform_process):
    platform = platform_process(data_dir=str(tmp_path / "data"), extra_env=SMALL_BOUNDS)
    key, _ = platform.setup()
    started(platform)
    try:
        rss = RssSampler(platform.proc.pid, interval=0.5).start()
        senders = Senders(platform.port, key, senders=4, retry_delay=0.1).start()
        worst_backlog = 0
        refusing_seen = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            state = readyz(platform)
            worst_backlog = max(worst_backlog, state["backlog_bytes"])
            if state["backpressure"] and refusing_seen is None:
                refusing_seen = state
            time.sleep(0.5)
        senders.stop()
        rss.stop()
        assert not senders.errors, senders.errors[:5]
        assert senders.refusals() > 0, "the platform never pushed back"
        text = metrics_text(platform)
        assert metric_value(text, "observatory_ingest_backpressure_refusals_total") == senders.refusals()
        assert refusing_seen is not None and refusing_seen["backpressure"] in ("backlog_bytes", "backlog_age")
        # The bound holds: exports are admitted one at a time against it, a few in flight at once.
        assert worst_backlog < 2 * int(SMALL_BOUNDS["INGEST_BACKLOG_MAX_BYTES"]), worst_backlog
        # Unbounded, RSS grew ~2,500 MiB/min (41 MiB/s) here. Bounded, it reaches ~900-1000 MiB in the first
        # ~20 s and then swings by 100-250 MiB around a floor that still creeps up while the process warms
        # (the 5-minute benchmark's second half: 6.6 MiB/min). Measured from 30 s to 90 s on a 2-core host shared
        # with other test runs (load average 2-6): 68, 71 and 69 MiB/min; with two busy loops beside it (load
        # average 8.5): 50. The bound is 2.5 times the highest. A leak of 3 MiB/s (180 MiB/min) kept by the
        # export handler measured 268 and fails it (the Theil-Sen slope over the last 60 s this replaced, bound
        # 360, read 270 and passed it).
        growth = floor_growth_mib_per_min(rss.samples, since=30)
        assert growth < 180, f"RSS's floor rose {growth:.0f} MiB/min from 30 s on: {rss.samples[::10]}"
        platform.wait_idle(120)
        assert readyz(platform)["backpressure"] is None
        lag_count = metric_value(metrics_text(platform), "observatory_ingest_queryable_lag_seconds_count")
        assert lag_count == senders.statuses[200], (lag_count, senders.statuses)
    finally:
        platform.stop(cleanup=False)
    assert_stored_exactly_once(str(Path(platform.data_dir) / "chdb"), senders.acked)
    print(f"overload: {len(senders.acked)} traces acked, {senders.refusals()} refusals, RSS peak "
          f"{rss.peak():.0f} MiB, floor growth {growth:.0f} MiB/min from 30 s on")


def _shutdown_phases(log: str, signalled_at: float, exited_at: float) -> dict[str, float | None]:
    """{signal → "shutting down", "stopped in" (the process's own figure), its line → exit}, from the log's stamps."""
    def stamp(pattern: str) -> float | None:
        found = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*" + pattern, log, re.M)
        if not found:
            return None
        return time.mktime(time.strptime(found.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(found.group(1)[20:]) / 1000

    began, stopped = stamp("shutting down"), stamp("stopped in")
    own = re.search(r"stopped in ([\d.]+)s", log)
    return {"to_handler": None if began is None else round(began - signalled_at, 2),
            "stopped_in": float(own.group(1)) if own else None,
            "to_exit": None if stopped is None else round(exited_at - stopped, 2)}


@pytest.mark.parametrize("cycles", [6])
def test_sigterm_at_a_large_backlog_exits_cleanly_every_time_and_resumes(tmp_path, platform_process, cycles):
    platform = platform_process(data_dir=str(tmp_path / "data"), extra_env={"LOG_LEVEL": "INFO"})
    key, _ = platform.setup()
    acked: list[str] = []
    exits = []
    per_cycle: list[tuple[int, int]] = []  # (traces acked in the cycle, acked so far)
    starts: list[int] = []  # where each process's part of the log begins
    for cycle in range(cycles):
        # Every other run leaves the decomposition idle between cycles (a long interval), so the backlog is
        # as large as the bounds allow when the signal comes; the shutdown's drain then decomposes chunks.
        platform.env["INGEST_DECOMPOSE_INTERVAL_SECONDS"] = "3600" if cycle % 2 else "0.5"
        starts.append(len(platform.log_tail(None)))
        started(platform)
        senders = Senders(platform.port, key, senders=4, retry_delay=0.1).start()
        time.sleep(4)
        backlog = readyz(platform)
        log_before = len(platform.log_tail(10_000_000))
        signalled, signalled_at = time.monotonic(), time.time()
        platform.proc.send_signal(signal.SIGTERM)
        code = platform.proc.wait(30)
        took = time.monotonic() - signalled
        exited_at = time.time()
        senders.stop()
        log = platform.log_tail(10_000_000)[log_before:]
        exits.append((code, round(took, 1), backlog["decomposition_pending"], backlog["backlog_bytes"]))
        # Where the time went: the signal to the process's "shutting down" line, its own "stopped in", and from that
        # line to its exit (timestamps of the platform's log, in seconds).
        phases = _shutdown_phases(log, signalled_at, exited_at)
        # The process's own stop (drain, decomposition, store closed) within 15 s; the whole, with the signal's
        # delivery and the interpreter's exit on a loaded 2-core host, within 25 s (a CI run: stopped in 8.2 s,
        # 18.3 s in all; this host under load: stopped in 3-6 s, 0.3-1.4 s more to exit).
        assert code == 0 and phases["stopped_in"] is not None and phases["stopped_in"] < 15 and took < 25, \
            (exits, phases, log[-3000:])
        print(f"cycle {cycle}: {phases}")
        assert not any(sign in log for sign in CRASH_SIGNS), log[-5000:]
        # Every export sent before the listener closed was answered: none failed with a reset.
        resets = [e for e in senders.errors if "Reset" in e or "RemoteDisconnected" in e or "BadStatusLine" in e]
        assert not resets, resets[:5]
        acked.extend(senders.acked)
        per_cycle.append((len(senders.acked), len(acked)))
    platform.env["INGEST_DECOMPOSE_INTERVAL_SECONDS"] = "0.5"
    starts.append(len(platform.log_tail(None)))
    started(platform)
    try:
        platform.wait_idle(300)
    finally:
        platform.stop(cleanup=False)
    log = platform.log_tail(None)
    # What each restart (the processes after the first) rebuilt; none when the last stop left nothing undone
    # and nothing was stored in the checkpoint's margin (a shutdown whose drain finished while refusing).
    rebuilt = []
    for begin, end in zip(starts[1:], starts[2:] + [len(log)]):
        found = re.findall(r"rebuilding (\d+) traces ingested before the last stop", log[begin:end])
        assert len(found) <= 1, found
        rebuilt.append(int(found[0]) if found else 0)
    print(f"SIGTERM exits (code, seconds, traces waiting, backlog bytes): {exits}; rebuilt on restart: {rebuilt}; "
          f"acked (in the cycle, so far): {per_cycle}")
    # Each restart queues again what the last process left undecomposed (at least its checkpoint's 5 s margin),
    # never more than was acknowledged. Whether it is less than everything depends on this machine: on a slow
    # one a process that lives 8 s, most of them replaying the spool into ClickHouse, finishes no chunk of the
    # traces it recovered, so its checkpoint stays where it was. That a restart rebuilds only what came after
    # the checkpoint is tests/traces/test_backlog.py's business, without the timing.
    assert len(rebuilt) == cycles and sum(1 for count in rebuilt if count) >= cycles // 2, rebuilt
    for (_in_cycle, so_far), count in zip(per_cycle, rebuilt):
        assert count <= so_far, (rebuilt, exits, per_cycle)
    assert_stored_exactly_once(str(Path(platform.data_dir) / "chdb"), acked)


def test_the_backlog_is_reported_while_it_waits(tmp_path, platform_process):
    """/readyz and /metrics tell traces and bytes waiting and the oldest one's age, also mid-backlog."""
    platform = platform_process(data_dir=str(tmp_path / "data"), extra_env={"INGEST_DECOMPOSE_INTERVAL_SECONDS": "3600"})
    key, _ = platform.setup()
    started(platform)
    try:
        senders = Senders(platform.port, key, senders=2, spans_per_second=20_000).start()
        time.sleep(2.5)
        senders.stop()
        state = wait_for(lambda: (s := readyz(platform))["spool_pending_bytes"] == 0 and s, 30)
        # Written, waiting for decomposition (the builder's next cycle is an hour away).
        assert state["decomposition_pending"] == len(senders.acked), state
        assert state["decomposition_pending_bytes"] > 0 and state["backlog_bytes"] == state["decomposition_pending_bytes"]
        assert state["backlog_oldest_seconds"] >= 1
        text = metrics_text(platform)
        assert metric_value(text, "observatory_decompose_pending_traces") == len(senders.acked)
        assert metric_value(text, "observatory_ingest_backlog_oldest_seconds") >= 1
        platform.stop(cleanup=False)  # the shutdown's drain decomposes some; the restart the rest
        platform.env["INGEST_DECOMPOSE_INTERVAL_SECONDS"] = "0.5"
        started(platform)
        platform.wait_idle(60)
        state = readyz(platform)
        assert state["decomposition_pending"] == 0 and state["backlog_bytes"] == 0 and state["backlog_oldest_seconds"] == 0
    finally:
        platform.stop()
