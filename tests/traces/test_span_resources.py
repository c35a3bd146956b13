"""Resource attributes are stored once per (resource, day) in `span_resources` (migration 0005), not on every
span row; spans spooled before that (attributes inline, no resource_id) are still written as they were.

In-process: records built by the ingest service go through the span writer into a store of their own.
"""
from __future__ import annotations

import json
import time

import pytest
from ingest.otlp import Limits, decode_protobuf
from ingest.rows import arrival_of, resource_id, span_row
from ingest.service import build_record
from ingest.spool import Spool
from ingest.writer import SpanWriter
from otlp_payloads import engine_span, pb_request, vllm_resource
from tenancy.keys import IngestIdentity
from traces import ch_migrate
from traces.row_encoding import encode_rows

DAY_NS = 86_400 * 1_000_000_000
PROJECT = 7


@pytest.fixture
def writer(make_store, tmp_path):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30, segment_bytes=1 << 26, fsync=False)
    yield SpanWriter(spool, store, batch_spans=1000, max_delay=0.01)
    spool.close()


def stored(store, sql: str) -> list[tuple]:
    return store.query(sql.format(spans=store.table("spans"), resources=store.table("span_resources")),
                       project_id=PROJECT)


RESOURCE_JOIN = (
    "SELECT s.span_id, s.resource_id, s.resource_attributes, "
    "if(s.resource_id = 0, s.resource_attributes, r.attributes) "
    "FROM {spans} AS s LEFT JOIN (SELECT * FROM {resources} FINAL) AS r "
    "ON r.project_id = s.project_id AND r.resource_id = s.resource_id AND r.day = toDate(s.start_time) "
    "WHERE s.project_id = {{project_id:UInt32}} ORDER BY s.span_id"
)


def test_resource_attributes_are_stored_once_and_join_back(writer):
    now = time.time_ns()
    today = [engine_span(start_ns=now - 60_000_000_000) for _ in range(3)]
    yesterday = [engine_span(start_ns=now - DAY_NS - 60_000_000_000)]
    other = [engine_span(start_ns=now - 60_000_000_000)]
    a, b = vllm_resource("engine-a"), {**vllm_resource("engine-b"), "host.cpu.count": 8}
    payload = pb_request((a, today + yesterday), (b, other)).SerializeToString()
    decoded = decode_protobuf(payload, Limits())
    record, _ = build_record(IngestIdentity(PROJECT, 30), decoded)
    again, _ = build_record(IngestIdentity(PROJECT, 30), decode_protobuf(payload, Limits()))
    writer._write([((1, 0), record), ((1, 1), again)])

    rows = stored(writer.store, RESOURCE_JOIN)
    assert len({r[0] for r in rows}) == 5
    expected = {span.span_id.hex(): a for span in today + yesterday} | {span.span_id.hex(): b for span in other}
    for span_id, rid, inline, joined in rows:
        assert rid == resource_id(decoded.spans[0].resource if expected[span_id] is a else decoded.spans[-1].resource)
        assert rid != 0 and inline == {}
        assert joined == {k: str(v) for k, v in expected[span_id].items()}
    # One row per resource and day (the second record's rows were known to be written already).
    resources = stored(writer.store, "SELECT resource_id, day, retention_days FROM {resources} "
                                     "WHERE project_id = {{project_id:UInt32}} ORDER BY day, resource_id")
    assert len(resources) == 3
    assert {r[2] for r in resources} == {30}


def test_a_longer_retention_wins_for_the_resource_row(writer):
    payload = pb_request((vllm_resource(), [engine_span()])).SerializeToString()
    short, _ = build_record(IngestIdentity(PROJECT, 7), decode_protobuf(payload, Limits()))
    long, _ = build_record(IngestIdentity(PROJECT, 90), decode_protobuf(payload, Limits()))
    writer._write([((1, 0), long)])
    writer._write([((1, 1), short)])
    rows = stored(writer.store, "SELECT retention_days FROM {resources} FINAL WHERE project_id = {{project_id:UInt32}}")
    assert rows == [(90,)]


def test_spans_spooled_before_the_resource_table_keep_their_attributes_inline(writer):
    """A spool written by the previous version (six-item records, no resource_id) replays as it was."""
    payload = pb_request((vllm_resource("old-engine"), [engine_span()])).SerializeToString()
    decoded = decode_protobuf(payload, Limits())
    rows = [span_row(PROJECT, 30, span, 0, "vllm")[:-1] for span in decoded.spans]  # the old row shape
    old_record = (PROJECT, [decoded.spans[0].trace_id], encode_rows(rows), b"", 1, 0)
    new_payload = pb_request((vllm_resource("new-engine"), [engine_span()])).SerializeToString()
    new_record, _ = build_record(IngestIdentity(PROJECT, 30), decode_protobuf(new_payload, Limits()))
    writer._write([((1, 0), old_record), ((1, 1), new_record)])

    by_service = {r[3]["service.name"]: r for r in stored(writer.store, RESOURCE_JOIN)}
    assert by_service["old-engine"][1] == 0
    assert by_service["old-engine"][2] == {k: str(v) for k, v in vllm_resource("old-engine").items()}
    assert by_service["new-engine"][1] != 0 and by_service["new-engine"][2] == {}


def test_resource_ids_are_stable_and_never_zero():
    assert resource_id({}) == 0
    resource = {"service.name": "x", "n": 1, "big": 2**70}
    assert resource_id(resource) == resource_id(dict(resource)) != 0
    assert resource_id(resource) != resource_id({**resource, "n": 2})


def test_calls_spooled_before_replica_groups_replay_beside_current_ones(writer):
    """Six- and seven-item records (written before migration 0006) hold call rows without replica_group,
    eight-item ones (format 3) no arrival time, format-4 ones no cache columns (migration 0012); they replay in
    the same batch as current records, whose calls keep their group and cached tokens."""
    def record_for(group: str | None):
        span = engine_span(prompt_tokens=100, extra={"gen_ai.usage.cache_read.input_tokens": 64})
        payload = pb_request((vllm_resource(replica_group=group), [span])).SerializeToString()
        record, _ = build_record(IngestIdentity(PROJECT, 30), decode_protobuf(payload, Limits()))
        return record

    def before_caches(record, length):
        calls = encode_rows([row[:-3] for row in json_rows(record[3])])
        return (*record[:3], calls, *record[4:7], 3 if length == 8 else 4, *record[8:length])

    current = record_for("canary")
    assert len(current) == 9 and arrival_of(current) > 0 and current[7] == 5
    nine = before_caches(record_for("stable"), 9)
    eight = before_caches(record_for("baseline"), 8)
    assert arrival_of(eight) is None
    old_calls = record_for(None)
    old_calls_blob = encode_rows([row[:-4] for row in json_rows(old_calls[3])])  # the old call row shape
    seven = (*old_calls[:3], old_calls_blob, *old_calls[4:7])
    six_source = record_for(None)
    six_spans = encode_rows([row[:-1] for row in json_rows(six_source[2])])
    six = (six_source[0], six_source[1], six_spans, encode_rows([row[:-4] for row in json_rows(six_source[3])]),
           *six_source[4:6])
    writer._write([((1, 0), six), ((1, 1), seven), ((1, 2), eight), ((1, 3), nine), ((1, 4), current)])

    calls = writer.store.query(
        f"SELECT trace_id, replica_group, cached_prompt_tokens FROM {writer.store.table('llm_calls')} FINAL "
        "WHERE project_id = {project_id:UInt32}", project_id=PROJECT)
    groups = {trace_id: (group, cached) for trace_id, group, cached in calls}
    assert groups == {six[1][0]: (None, None), seven[1][0]: (None, None), eight[1][0]: ("baseline", None),
                      nine[1][0]: ("stable", None), current[1][0]: ("canary", 64)}


def json_rows(blob: bytes) -> list[list]:
    return [json.loads(line) for line in blob.splitlines()]
