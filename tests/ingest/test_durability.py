"""Durability of ingest with real platform processes and a real chdb store.

"A 2xx means durable" (docs/ingest.md, "Durability: the spool"): whatever was acknowledged must end up in
ClickHouse exactly once, across SIGKILL, replays of the spool, ClickHouse being unavailable, and a full spool.

ClickHouse is made unavailable for real by a helper process that opens the platform's chdb
directory first: chdb lets one process open a directory, so the platform's store raises
StoreUnavailable until the helper exits (see otlp_live_helpers.ChdbHolder).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import grpc
import pytest
from benchkit.payloads import chain_batch
from google.rpc import error_details_pb2, status_pb2
from otlp_live_helpers import (
    ChdbHolder,
    grpc_export,
    metric_value,
    metrics_text,
    post_traces,
    readyz,
    requests_for,
    stored_span_counts,
    summary_total,
    to_otlp_json,
    wait_for,
)

# Mode-independent (the spool and ClickHouse; the database only looks the key up): CI runs it once, in the embedded suite (tests/conftest.py).
pytestmark = pytest.mark.mode_independent(suite="embedded")

# The writer would rather wait than write: makes "kill right after the ack" hit un-drained data.
HOLD_OFF = {"INGEST_WRITER_MAX_DELAY_SECONDS": "30", "INGEST_WRITER_BATCH_SPANS": "100000000"}
NORMAL = {"INGEST_WRITER_MAX_DELAY_SECONDS": "0.2", "INGEST_WRITER_BATCH_SPANS": "20000",
          "INGEST_DECOMPOSE_INTERVAL_SECONDS": "0.5"}
SPANS_PER_TRACE = 3  # chain_batch: client -> gateway -> vLLM engine


def send_chains(platform, batches: int, traces_per_batch: int, seed: int, *, protocols=("proto",)) -> list[str]:
    """Send `batches` export requests of complete chains, cycling through the protocols; all must be acked."""
    rng = random.Random(seed)
    trace_ids = []
    for i in range(batches):
        body, ids = chain_batch(traces_per_batch, rng)
        protocol = protocols[i % len(protocols)]
        if protocol == "grpc":
            code, _ = grpc_export(platform.grpc_target, platform.keys["alpha"], body)
            assert code == grpc.StatusCode.OK, code
        else:
            status, _, answer = post_traces(platform.process, platform.keys["alpha"],
                                            to_otlp_json(body) if protocol == "json" else body,
                                            as_json=protocol == "json", gzipped=protocol == "gzip")
            assert status == 200, answer
        trace_ids.extend(ids)
    return trace_ids


def restart(platform, **env) -> None:
    """Start the platform process again on the same data directory (after kill or stop)."""
    platform.process.env.update(NORMAL)
    platform.process.env.update(env)
    platform.process.start()


def assert_exactly_once(platform, trace_ids: list[str]) -> None:
    """Every trace has exactly its one request row, complete (all three hops), and nothing else exists."""
    token = platform.tokens["alice"]
    problems = []
    for trace_id in trace_ids:
        rows = requests_for(platform.process, token, trace_id)
        if len(rows) != 1:
            problems.append(f"{trace_id}: {len(rows)} request rows")
            continue
        row = rows[0]
        if [hop["role"] for hop in row["hops"]] != ["client", "gateway", "engine"]:
            problems.append(f"{trace_id}: hops {row['hops']}")
        if any(row[name] is None for name in ("e2e_ms", "network_ms", "overhead_ms", "queue_ms", "prefill_ms",
                                              "decode_ms")):
            problems.append(f"{trace_id}: incomplete decomposition {row}")
    assert not problems, f"{len(problems)} of {len(trace_ids)} traces wrong, e.g. {problems[:5]}"
    assert summary_total(platform.process, token) == len(trace_ids)


def assert_spans_stored_once(platform, trace_ids: list[str]) -> None:
    """Stop the platform (it owns the chdb directory) and count the raw spans of these traces."""
    platform.process.stop(cleanup=False)
    counts = stored_span_counts(str(Path(platform.process.data_dir) / "chdb"), trace_ids)
    expected = SPANS_PER_TRACE * len(trace_ids)
    assert counts == {"distinct": expected, "final": expected}, counts


def deadletters(platform) -> float:
    return metric_value(metrics_text(platform.process), "observatory_spool_deadletter_records_total")


# -- SIGKILL ---------------------------------------------------------------------------------------
def test_kill_9_right_after_the_ack_loses_and_duplicates_nothing(fresh_platform_factory):
    platform = fresh_platform_factory(extra_env=HOLD_OFF)
    trace_ids = send_chains(platform, batches=8, traces_per_batch=5, seed=1, protocols=("proto", "json", "gzip"))
    platform.process.kill()  # no flush, no drain, no checkpoint

    restart(platform)
    platform.process.wait_idle(90)
    assert_exactly_once(platform, trace_ids)
    assert deadletters(platform) == 0
    assert_spans_stored_once(platform, trace_ids)


def test_kill_9_before_anything_reached_clickhouse(fresh_platform_factory):
    """Deterministic: the store is held by another process, so every acked span is only in the spool
    when the platform is killed; the restarted platform must replay all of it."""
    platform = fresh_platform_factory()
    data_dir = Path(platform.process.data_dir)
    platform.process.stop(cleanup=False)
    with ChdbHolder(data_dir / "chdb"):
        restart(platform)
        assert readyz(platform.process)["clickhouse"] is False
        trace_ids = send_chains(platform, batches=6, traces_per_batch=4, seed=2,
                                protocols=("proto", "grpc", "json"))
        state = readyz(platform.process)
        assert state["spool_pending_bytes"] > 0, state
        platform.process.kill()
    restart(platform)
    platform.process.wait_idle(90)
    assert_exactly_once(platform, trace_ids)
    assert metric_value(metrics_text(platform.process), "observatory_clickhouse_inserted_rows_total",
                        'table="spans"') >= SPANS_PER_TRACE * len(trace_ids)
    assert_spans_stored_once(platform, trace_ids)


def test_full_replay_of_rows_already_in_clickhouse_adds_no_duplicates(fresh_platform_factory):
    """Killed after the rows reached ClickHouse but before the checkpoint moved: forced here by removing
    the checkpoint, so the whole spool is written a second time on restart."""
    platform = fresh_platform_factory()
    trace_ids = send_chains(platform, batches=6, traces_per_batch=5, seed=3, protocols=("proto", "gzip"))
    platform.process.wait_idle(60)
    assert_exactly_once(platform, trace_ids)
    platform.process.kill()

    checkpoint = Path(platform.process.data_dir) / "spool" / "checkpoint"
    assert checkpoint.exists()
    checkpoint.unlink()
    restart(platform)
    platform.process.wait_idle(90)
    # The replay really happened (the rows were written again) ...
    assert metric_value(metrics_text(platform.process), "observatory_clickhouse_inserted_rows_total",
                        'table="spans"') >= SPANS_PER_TRACE * len(trace_ids)
    # ... and changed nothing that can be seen.
    assert_exactly_once(platform, trace_ids)
    # More data after the replay still works and is counted once.
    more = send_chains(platform, batches=2, traces_per_batch=3, seed=4)
    platform.process.wait_idle(60)
    assert_exactly_once(platform, trace_ids + more)
    assert_spans_stored_once(platform, trace_ids + more)


def _wait_written_not_decomposed(platform, count: int) -> None:
    def written():
        state = readyz(platform.process)
        return state["spool_pending_bytes"] == 0 and state["decomposition_pending"] >= count

    wait_for(written, 30, message=f"spans not written: {readyz(platform.process)}")


def test_kill_9_after_the_spans_were_written_but_before_decomposition(fresh_platform_factory):
    """The spool checkpoint has moved past the spans (no replay), but their request rows were never
    computed: the restarted platform must find and decompose those traces (RequestBuilder.recover)."""
    platform = fresh_platform_factory()
    warmup = send_chains(platform, batches=1, traces_per_batch=2, seed=5)
    platform.process.wait_idle(60)  # at least one decomposition cycle completed
    platform.process.stop(cleanup=False)

    restart(platform, INGEST_DECOMPOSE_INTERVAL_SECONDS="3600")  # the builder never runs on its own
    trace_ids = send_chains(platform, batches=4, traces_per_batch=5, seed=6)
    _wait_written_not_decomposed(platform, 1)
    assert requests_for(platform.process, platform.tokens["alice"], trace_ids[0]) == []
    platform.process.kill()

    restart(platform)
    platform.process.wait_idle(90)
    assert_exactly_once(platform, warmup + trace_ids)


def test_kill_9_before_the_first_decomposition_cycle_ever(fresh_platform_factory):
    """Same as above on a platform whose builder never completed a cycle (killed within its first
    interval): there is no `decomposed_until` watermark yet, and the written traces still must be
    decomposed after the restart."""
    platform = fresh_platform_factory(extra_env={"INGEST_DECOMPOSE_INTERVAL_SECONDS": "3600"})
    trace_ids = send_chains(platform, batches=3, traces_per_batch=5, seed=7)
    _wait_written_not_decomposed(platform, 1)
    platform.process.kill()

    restart(platform)
    platform.process.wait_idle(90)
    assert_exactly_once(platform, trace_ids)


# -- ClickHouse unavailable ------------------------------------------------------------------------
def test_clickhouse_unavailable_ingest_stays_up_and_catches_up(fresh_platform_factory):
    platform = fresh_platform_factory()
    data_dir = Path(platform.process.data_dir)
    platform.process.stop(cleanup=False)
    holder = ChdbHolder(data_dir / "chdb").acquire()
    try:
        restart(platform)
        state = readyz(platform.process)
        assert state["ingest"] is True and state["clickhouse"] is False
        # The decomposition's trace filter cannot read back what the store holds: every trace is looked
        # up until it can (traces/trace_filter.py).
        assert state["trace_filter"] == "loading", state
        trace_ids = send_chains(platform, batches=6, traces_per_batch=4, seed=8,
                                protocols=("proto", "grpc", "json", "gzip"))
        time.sleep(1.0)  # the writer has tried (and failed) meanwhile
        state = readyz(platform.process)
        assert state["spool_pending_bytes"] > 0 and state["clickhouse"] is False, state
        # The API says the store is away instead of answering with partial data.
        status, body = platform.process.get(f"/api/v1/requests?trace_id={trace_ids[0]}", platform.tokens["alice"])
        assert status == 503, body
        assert metric_value(metrics_text(platform.process), "observatory_clickhouse_unavailable_total") > 0
    finally:
        holder.release()
    # No restart: the running platform reconnects by itself (writer backoff is capped at 10 s).
    platform.process.wait_idle(60)
    assert readyz(platform.process)["clickhouse"] is True
    assert_exactly_once(platform, trace_ids)
    assert deadletters(platform) == 0
    assert_spans_stored_once(platform, trace_ids)


def test_clickhouse_unavailable_when_a_fresh_platform_first_starts(fresh_platform_factory, tmp_path):
    """First start of a new install while ClickHouse is away: the schema could not be created at start,
    ingest still acks into the spool, and once ClickHouse is back everything must arrive (the tables
    have to be created then, not the data dead-lettered)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    holder = ChdbHolder(data_dir / "chdb").acquire()
    try:
        platform = fresh_platform_factory(data_dir=str(data_dir))
        assert readyz(platform.process)["clickhouse"] is False
        trace_ids = send_chains(platform, batches=3, traces_per_batch=4, seed=9)
        time.sleep(0.5)
    finally:
        holder.release()
    wait_for(lambda: readyz(platform.process)["spool_pending_bytes"] == 0, 40,
             message="the spool did not drain once ClickHouse was back")
    assert deadletters(platform) == 0, "acked spans were dead-lettered: the tables did not exist"
    platform.process.wait_idle(40)
    assert_exactly_once(platform, trace_ids)


def test_traces_left_undecomposed_are_recovered_even_if_clickhouse_is_away_at_restart(fresh_platform_factory):
    """Spans written, platform killed before decomposing them, restarted while ClickHouse is away:
    recovery must not be skipped for good once ClickHouse is back."""
    platform = fresh_platform_factory()
    warmup = send_chains(platform, batches=1, traces_per_batch=2, seed=10)
    platform.process.wait_idle(60)
    platform.process.stop(cleanup=False)
    restart(platform, INGEST_DECOMPOSE_INTERVAL_SECONDS="3600")
    trace_ids = send_chains(platform, batches=3, traces_per_batch=4, seed=11)
    _wait_written_not_decomposed(platform, 1)
    platform.process.kill()

    with ChdbHolder(Path(platform.process.data_dir) / "chdb"):
        restart(platform)
        time.sleep(2.0)  # several decomposition cycles run while the store is away
    platform.process.wait_idle(60)
    wait_for(lambda: readyz(platform.process)["clickhouse"], 30)
    platform.process.wait_idle(60)
    assert_exactly_once(platform, warmup + trace_ids)


# -- a full spool ----------------------------------------------------------------------------------
def test_full_spool_answers_503_and_unavailable_and_keeps_what_it_acked(fresh_platform_factory):
    platform = fresh_platform_factory(extra_env={"INGEST_SPOOL_MAX_BYTES": "200000",
                                                 "INGEST_RETRY_AFTER_SECONDS": "7"})
    platform.process.stop(cleanup=False)
    rng = random.Random(12)
    accepted: list[str] = []
    refused: list[str] = []
    with ChdbHolder(Path(platform.process.data_dir) / "chdb"):
        restart(platform)
        for _ in range(400):
            body, ids = chain_batch(5, rng)
            status, headers, answer = post_traces(platform.process, platform.keys["alpha"], body)
            if status == 200:
                accepted.extend(ids)
                continue
            assert status == 503, (status, answer)
            assert headers.get("retry-after") == "7"
            refused.extend(ids)
            break
        assert accepted and refused, "the spool never filled up"
        assert readyz(platform.process)["spool_pending_bytes"] > 0

        # Still full: OTLP/HTTP JSON answers 503 too, and OTLP/gRPC says UNAVAILABLE with a retry delay.
        body, ids = chain_batch(5, rng)
        status, headers, answer = post_traces(platform.process, platform.keys["alpha"], to_otlp_json(body),
                                              as_json=True)
        assert status == 503 and headers.get("retry-after") == "7", (status, answer)
        refused.extend(ids)
        body, ids = chain_batch(5, rng)
        code, trailers = grpc_export(platform.grpc_target, platform.keys["alpha"], body)
        assert code == grpc.StatusCode.UNAVAILABLE
        refused.extend(ids)
        details = trailers.get("grpc-status-details-bin")
        if details is not None:
            status_detail = status_pb2.Status.FromString(details)
            retry = error_details_pb2.RetryInfo()
            assert any(d.Unpack(retry) for d in status_detail.details)
            assert retry.retry_delay.seconds == 7
    # ClickHouse is back: the backlog drains and new data is accepted again.
    platform.process.wait_idle(60)
    more = send_chains(platform, batches=1, traces_per_batch=3, seed=13)
    platform.process.wait_idle(60)
    assert_exactly_once(platform, accepted + more)
    for trace_id in refused[:10]:
        assert requests_for(platform.process, platform.tokens["alice"], trace_id) == []
    assert deadletters(platform) == 0
