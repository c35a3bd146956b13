"""The decomposition's filter of recently written traces (traces/trace_filter.py) and how the request
builder uses it: traces new to the store are decomposed from memory with no lookup, late spans of a
known trace still join it (also after a restart, through the filter loaded back from ClickHouse), and
rows whose key a late span moved are cancelled from what the builder remembers writing."""
from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest
from benchkit.payloads import chain_batch
from ingest.otlp import Decoded, Limits, decode_protobuf
from ingest.service import build_record
from ingest.spool import Spool
from ingest.writer import SpanWriter
from tenancy.keys import IngestIdentity
from traces import ch_migrate, metrics
from traces.request_builder import RequestBuilder
from traces.trace_filter import TRACE_HASH_SQL, TraceFilter, raw_hashes

PROJECT = 7


def trace_ids(n: int) -> list[str]:
    return [os.urandom(16).hex() for _ in range(n)]


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


# -- the filter on its own ---------------------------------------------------------------------------
def test_no_trace_written_within_the_window_is_ever_reported_new():
    f = TraceFilter(3600)
    f.ready.set()
    written = trace_ids(300_000)  # beyond the first filter's size: it keeps answering, less sharply
    for i in range(0, len(written), 999):
        f.check_and_add(PROJECT, written[i:i + 999])
    assert f.check_and_add(PROJECT, written).all()


def test_false_positives_stay_rare_at_the_sized_load():
    f = TraceFilter(3600)
    f.ready.set()
    f.reserve(100_000)
    f.check_and_add(PROJECT, trace_ids(100_000))
    assert f.check_and_add(PROJECT, trace_ids(50_000)).mean() < 0.01


def test_every_trace_counts_as_seen_until_the_filter_is_ready():
    f = TraceFilter(3600)
    ids = trace_ids(50)
    assert f.check_and_add(PROJECT, ids).all()
    f.ready.set()
    assert not f.check_and_add(PROJECT, trace_ids(50)).any()


def test_projects_are_kept_apart():
    f = TraceFilter(3600)
    f.ready.set()
    ids = trace_ids(2000)
    f.check_and_add(PROJECT, ids)
    assert f.check_and_add(PROJECT + 1, ids).mean() < 0.02


def test_ids_that_are_not_random_spread_over_the_filter():
    f = TraceFilter(3600)
    f.ready.set()
    f.check_and_add(PROJECT, [f"{i:032x}" for i in range(50_000)])  # sequential, as some test generators make
    assert f.check_and_add(PROJECT, [f"{i:032x}" for i in range(50_000, 60_000)]).mean() < 0.01
    half = [f"{0:016x}{i:016x}" for i in range(60_000, 70_000)]  # 64-bit ids written as 128-bit
    assert f.check_and_add(PROJECT, half).mean() < 0.01


def test_a_trace_is_remembered_for_at_least_the_window_and_forgotten_after_two():
    clock = Clock()
    f = TraceFilter(600, clock=clock)
    f.ready.set()
    early = trace_ids(10)
    f.check_and_add(PROJECT, early)
    for minute in range(1, 25):  # traffic every minute keeps the filters turning over
        clock.now += 60
        f.check_and_add(PROJECT, trace_ids(10))
        remembered = f.may_contain(PROJECT, early)
        if minute * 60 <= 600:
            assert remembered.all(), minute  # never forgotten within the window
        if minute * 60 >= 1200:
            assert not remembered.any(), minute  # gone after two windows: memory stays bounded


def test_the_loader_hash_computed_by_clickhouse_is_the_one_computed_in_python(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    ids = trace_ids(500) + ["0" * 16 + "00000000000000ff", "f" * 32]
    store.tenant_command(
        # retention_days set: left at 0, the table's TTL may drop the rows before they are read back
        f"INSERT INTO {store.table('spans')} (project_id, trace_id, span_id, start_time, end_time, retention_days) "
        "SELECT {project_id:UInt32}, arrayJoin({ids:Array(String)}), 'aaaaaaaaaaaaaaaa', now64(9), now64(9), 30",
        project_id=PROJECT, parameters={"ids": ids},
    )
    from_store = store.query_uint64(
        f"SELECT {TRACE_HASH_SQL} FROM {store.table('spans')} WHERE project_id = {{project_id:UInt32}}",
        project_id=PROJECT,
    )
    assert sorted(from_store.tolist()) == sorted(raw_hashes(ids, len(ids)).tolist())
    loaded = TraceFilter(3600)
    loaded.load(PROJECT, from_store)
    loaded.ready.set()
    assert loaded.check_and_add(PROJECT, ids).all()


# -- the request builder with the filter ---------------------------------------------------------------
@pytest.fixture
def pipeline(make_store, tmp_path):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30, segment_bytes=1 << 26, fsync=False)
    writer = SpanWriter(spool, store, batch_spans=1000, max_delay=0.01)
    yield store, writer, tmp_path
    spool.close()


def builder_for(store, state_dir, window=3600.0) -> RequestBuilder:
    builder = RequestBuilder(store, interval=3600, state_dir=state_dir, project_ids=lambda: [PROJECT],
                             trace_window=window)
    builder.load_filter()  # what the builder's loader thread does at start
    return builder


def decoded_traces(traces: int, seed: int) -> Decoded:
    payload, _ = chain_batch(traces, random.Random(seed))
    return decode_protobuf(payload, Limits())


def deliver(store, writer, builder, spans, position) -> None:
    """Write these spans as one spool record (as the span writer does) and decompose what they touched."""
    decoded = Decoded(spans, [0] * len(spans), Counter())
    record, memo = build_record(IngestIdentity(PROJECT, 30), decoded)
    assert writer._write([(position, record)]) == set()
    builder.mark_written([(record, memo)])
    builder.cycle()


def live_rows(store) -> list[tuple]:
    return store.query(
        f"SELECT trace_id, request_key, e2e_ms, network_ms, hops FROM {store.table('llm_requests')} FINAL "
        "WHERE project_id = {project_id:UInt32} ORDER BY trace_id, request_key",
        project_id=PROJECT,
    )


def source_counts() -> dict[str, float]:
    return {s: metrics.DECOMPOSE_TRACE_SOURCES.labels(s)._value.get() for s in ("memory", "memory_checked", "store")}


def test_new_traces_are_decomposed_from_memory_and_late_spans_still_join(pipeline):
    store, writer, tmp = pipeline
    builder = builder_for(store, tmp)
    spans = decoded_traces(20, seed=1).spans
    engines = [s for s in spans if s.service == "vllm"]
    others = [s for s in spans if s.service != "vllm"]

    before = source_counts()
    deliver(store, writer, builder, engines, (0, 0))
    after = source_counts()
    assert after["memory"] - before["memory"] == 20  # new to the store: no lookup
    assert after["memory_checked"] == before["memory_checked"] and after["store"] == before["store"]
    rows = live_rows(store)
    assert len(rows) == 20 and all(r[3] is None for r in rows)  # engine-only rows: no network yet

    deliver(store, writer, builder, others, (0, 1))  # the client and gateway spans come later
    assert source_counts()["memory"] - after["memory"] == 20  # still the remembered, complete traces
    rows = live_rows(store)
    assert len(rows) == 20
    assert all(r[3] is not None and len(json.loads(r[4])) == 3 for r in rows)


def test_a_row_whose_key_a_late_span_moves_is_cancelled_without_a_lookup(pipeline):
    store, writer, tmp = pipeline
    builder = builder_for(store, tmp)
    spans = decoded_traces(10, seed=2).spans
    gateways_and_clients = [s for s in spans if s.service != "vllm"]
    engines = [s for s in spans if s.service == "vllm"]

    deliver(store, writer, builder, gateways_and_clients, (0, 0))
    first = live_rows(store)
    assert {r[1] for r in first} == {s.span_id for s in spans if s.service == "llm-gateway"}  # gateway-anchored
    deliver(store, writer, builder, engines, (0, 1))
    second = live_rows(store)
    # the engine now anchors each request: the gateway-keyed rows are gone, one row per trace is left
    assert {r[1] for r in second} == {s.span_id for s in engines}
    assert len(second) == 10


def test_after_a_restart_late_spans_join_the_traces_written_before_it(pipeline):
    store, writer, tmp = pipeline
    spans = decoded_traces(15, seed=3).spans
    engines = [s for s in spans if s.service == "vllm"]
    others = [s for s in spans if s.service != "vllm"]
    deliver(store, writer, builder_for(store, tmp / "first"), engines, (0, 0))

    restarted = builder_for(store, tmp / "second")  # fresh memory; the filter is loaded from ClickHouse
    assert restarted.filter.check_and_add(PROJECT, sorted({s.trace_id for s in engines})).all()
    before = source_counts()
    deliver(store, writer, restarted, others, (1, 0))
    assert source_counts()["memory"] == before["memory"]  # known to the store: not trusted blindly
    rows = live_rows(store)
    assert len(rows) == 15 and all(r[3] is not None for r in rows)


def test_without_a_window_every_trace_is_looked_up(pipeline):
    store, writer, tmp = pipeline
    builder = RequestBuilder(store, interval=3600, state_dir=tmp, project_ids=lambda: [PROJECT], trace_window=0)
    assert builder.filter is None and builder.filter_state() == "off"
    before = source_counts()
    deliver(store, writer, builder, decoded_traces(5, seed=4).spans, (0, 0))
    after = source_counts()
    assert after["memory"] == before["memory"] and after["memory_checked"] - before["memory_checked"] == 5
    assert len(live_rows(store)) == 5


def test_records_clickhouse_refuses_are_not_reported_as_written(make_store, tmp_path):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30, segment_bytes=1 << 26, fsync=False)
    reported = []
    writer = SpanWriter(spool, store, batch_spans=1000, max_delay=0.01,
                        on_written=lambda items, written_ms: reported.extend(items))
    good, memo = build_record(IngestIdentity(PROJECT, 30), decoded_traces(2, seed=5))
    bad = (*good[:2], b'["not a span row"]', *good[3:])  # ClickHouse cannot parse it: dead-lettered
    spool.append(good, memo)
    spool.append(bad, memo)
    writer.start()
    try:
        assert writer.wait_idle(30)
    finally:
        writer.stop()
        writer.join(10)
        spool.close()
    assert [record for record, _ in reported] == [good]
    assert len(list((tmp_path / "spool" / "deadletter").iterdir())) == 1
