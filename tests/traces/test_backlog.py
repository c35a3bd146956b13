"""The decomposition's backlog (traces/backlog.py) and the request builder's chunked steps on it: oldest
traces first, a trace reported again keeps its place, the writer waits while it is full, a failed chunk
waits again in its place, batches complete in order (their lag then known), and the checkpoint written
after each chunk lets a restarted builder rebuild only what came after it."""
from __future__ import annotations

import random
import threading
import time

import pytest
from benchkit.payloads import chain_batch
from ingest.otlp import Limits, decode_protobuf
from ingest.service import build_record
from ingest.spool import Spool
from ingest.writer import SpanWriter
from tenancy.keys import IngestIdentity
from traces import ch_migrate
from traces.backlog import DecompositionBacklog
from traces.request_builder import RequestBuilder
from traces.store import StoreUnavailable

PROJECT = 5


def record(traces: list[str], project: int = PROJECT, arrival: float | None = 100.0, size: int = 10) -> tuple:
    """A spool record as far as the backlog reads one: project, trace ids, two blobs, counts, format, arrival."""
    base = (project, traces, b"s" * size, b"c" * size, len(traces), 0, (), 4)
    return base if arrival is None else (*base, arrival)


def taken(chunk) -> list[str]:
    return [t for traces in chunk.traces.values() for t, _ in traces]


def test_oldest_traces_first_and_a_trace_reported_again_keeps_its_place():
    backlog = DecompositionBacklog(max_traces=100)
    backlog.add_written([(record(["a", "b"]), None)], written_ms=1000)
    backlog.add_written([(record(["c", "a"]), None)], written_ms=2000)  # a: already waiting
    assert backlog.traces() == 3
    chunk = backlog.take(2)
    assert taken(chunk) == ["a", "b"]
    assert backlog.traces() == 3  # two in flight, one waiting
    # Reported again while being decomposed: it waits again, at the end.
    backlog.add_written([(record(["a"]), None)], written_ms=3000)
    assert backlog.done(chunk) == [backlog_batch(1000)]
    assert taken(backlog.take(10)) == ["c", "a"]


def backlog_batch(written_ms: int):
    """Compare completed batches by when they were written."""
    class Written:
        def __eq__(self, other):
            return other.written_ms == written_ms

        def __repr__(self):
            return f"<batch written at {written_ms}>"

    return Written()


def test_batches_complete_in_order_with_their_arrivals_and_bytes():
    backlog = DecompositionBacklog(max_traces=100)
    backlog.add_written([(record(["a"], arrival=10.0, size=100), None),
                         (record(["b"], arrival=11.0, size=50), None)], written_ms=1000)
    backlog.add_written([(record(["c"], arrival=None, size=7), None)], written_ms=2000)  # format 3: no arrival
    assert backlog.pending_bytes() == 2 * 150 + 2 * 7
    assert backlog.oldest() == (1000, 10.0)
    first = backlog.take(1)  # "a" only: the first batch still has "b"
    assert backlog.done(first) == []
    rest = backlog.take(10)
    complete = backlog.done(rest)
    assert [b.written_ms for b in complete] == [1000, 2000]
    assert complete[0].arrivals == [10.0, 11.0] and complete[1].arrivals == []
    assert backlog.pending_bytes() == 0 and backlog.oldest() is None and backlog.idle()


def test_a_failed_chunk_waits_again_in_its_place_and_nothing_is_counted_twice():
    backlog = DecompositionBacklog(max_traces=100)
    backlog.add_written([(record(["a", "b", "c"]), ("memo",))], written_ms=1000)
    chunk = backlog.take(2)
    assert chunk.memos == [(PROJECT, ["a", "b", "c"], ("memo",))]  # not the record's row blobs
    backlog.add_written([(record(["b"]), None)], written_ms=2000)  # b reported again meanwhile
    backlog.put_back(chunk)
    again = backlog.take(10)
    assert taken(again) == ["a", "b", "c"] and again.memos == chunk.memos
    # b belongs to the first batch again: finishing all three completes both batches, none twice.
    assert [b.written_ms for b in backlog.done(again)] == [1000, 2000]
    assert backlog.idle()


def test_the_writer_waits_while_the_backlog_is_full():
    backlog = DecompositionBacklog(max_traces=3)
    backlog.add_written([(record(["a", "b", "c"]), None)], written_ms=1000)
    assert not backlog.has_room()
    assert backlog.wait_for_room(0.05) is False
    got = []
    waiter = threading.Thread(target=lambda: got.append(backlog.wait_for_room(5)))
    waiter.start()
    time.sleep(0.1)
    assert not got
    backlog.take(2)  # taking makes room
    waiter.join(5)
    assert got == [True]


def test_recovered_traces_come_in_slices_ordered_by_their_first_write():
    backlog = DecompositionBacklog(max_traces=100)
    added = backlog.add_recovered(PROJECT, [("late", 3000), ("early", 1000), ("mid", 2000)], slice_traces=2)
    assert added == 3
    assert backlog.oldest() == (1000, None)
    chunk = backlog.take(2)
    assert taken(chunk) == ["early", "mid"]
    assert [b.written_ms for b in backlog.done(chunk)] == [1000]
    assert backlog.oldest() == (3000, None)


def test_recovered_traces_go_before_what_was_written_since_the_start():
    """After a restart the writer may store the spool's leftovers before the recovery has read: the older,
    recovered traces are still decomposed first, so the checkpoint moves past them at once."""
    backlog = DecompositionBacklog(max_traces=100)
    backlog.add_written([(record(["new", "both"]), None)], written_ms=9000)
    added = backlog.add_recovered(PROJECT, [("old2", 2000), ("both", 2500), ("old1", 1000)], slice_traces=1)
    assert added == 2  # "both" waits already, in its place
    assert backlog.oldest() == (1000, None)
    chunk = backlog.take(2)
    assert taken(chunk) == ["old1", "old2"]
    assert [b.written_ms for b in backlog.done(chunk)] == [1000, 2000, 2500]  # the slice of "both" is empty
    assert backlog.oldest() == (9000, 100.0)
    assert taken(backlog.take(10)) == ["new", "both"]


# -- the builder's chunks, checkpoint and resume, on a real store ------------------------------------------
@pytest.fixture
def store(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    return store


@pytest.fixture
def write(store, tmp_path):
    """write(batches, traces, seed): store client → gateway → engine batches as the span writer does (its
    insert, no thread); returns [(items as reported to the builder, trace ids)] per batch."""
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30, segment_bytes=1 << 26, fsync=False)
    writer = SpanWriter(spool, store, batch_spans=1000, max_delay=0.01)

    def written(batches: int, traces: int, seed: int):
        out = []
        rng = random.Random(seed)
        for i in range(batches):
            payload, ids = chain_batch(traces, rng)
            rec, memo = build_record(IngestIdentity(PROJECT, 30), decode_protobuf(payload, Limits()))
            assert writer._write([((0, i), rec)]) == set()
            out.append(([(rec, memo)], ids))
        return out

    yield written
    spool.close()


def live_rows(store) -> int:
    return store.query(f"SELECT count() FROM {store.table('llm_requests')} FINAL "
                       "WHERE project_id = {project_id:UInt32} AND is_deleted = 0", project_id=PROJECT)[0][0]


def test_the_builder_works_in_chunks_moves_the_checkpoint_and_stops_between_chunks(store, write, tmp_path):
    builder = RequestBuilder(store, interval=3600, state_dir=tmp_path, chunk_traces=40)
    batches = write(batches=5, traces=30, seed=1)
    for items, _ in batches:
        builder.mark_written(items)
    assert builder.pending_traces() == 150
    assert builder.step() == 40  # one chunk
    assert live_rows(store) == 40
    first = builder.watermark_ms()
    assert first is not None
    builder.stop()  # a cycle stops at the next chunk boundary
    assert builder.cycle() == 40
    assert builder.pending_traces() == 70 and live_rows(store) == 80
    assert builder.watermark_ms() >= first


def test_a_chunk_that_fails_leaves_its_traces_waiting_and_the_checkpoint_where_it_was(store, write, tmp_path):
    builder = RequestBuilder(store, interval=3600, state_dir=tmp_path, chunk_traces=50)
    (items, ids), = write(batches=1, traces=20, seed=2)
    builder.mark_written(items, written_ms=12345)
    store.shutdown(timeout=5)  # every call now fails: the store is closing
    with pytest.raises(StoreUnavailable):
        builder.step()
    assert builder.pending_traces() == 20 and builder.watermark_ms() is None


def test_a_restarted_builder_rebuilds_only_what_came_after_its_checkpoint(store, write, tmp_path):
    builder = RequestBuilder(store, interval=3600, state_dir=tmp_path, chunk_traces=30)
    early = write(batches=2, traces=30, seed=3)
    # Recovery reads back from 5 s before the checkpoint (clock skew between hosts): let these be older.
    time.sleep(5.2)
    for items, _ in early:
        builder.mark_written(items)
    assert builder.cycle() == 60  # done, the checkpoint after them
    # Stored after the checkpoint, but the process stops before decomposing them.
    later = write(batches=2, traces=30, seed=4)
    restarted = RequestBuilder(store, interval=3600, state_dir=tmp_path, chunk_traces=30, project_ids=lambda: [PROJECT])
    restarted._prepare()
    assert restarted.pending_traces() == 60  # only what came after the checkpoint
    assert restarted.cycle() == 60
    assert live_rows(store) == 120
    later_ids = {t for _, ids in later for t in ids}
    rows = store.query(f"SELECT DISTINCT trace_id FROM {store.table('llm_requests')} FINAL "
                       "WHERE project_id = {project_id:UInt32} AND is_deleted = 0", project_id=PROJECT)
    assert later_ids <= {r[0] for r in rows}
