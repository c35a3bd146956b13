"""ingest.spool.Spool: the write-ahead spool every acknowledged export goes through.

Only the public surface is used (append / read_from / commit / pending_bytes / checkpoint /
close, plus the segment files on disk for crash simulation), so the tests hold whatever
the record encoding becomes.
"""
from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
from ingest.spool import Spool, SpoolFull

BIG = 1 << 40


def record(i: int, size: int = 3) -> tuple:
    """A record shaped like the ingest service's: (project_id, span_rows, call_rows, trace_ids)."""
    trace_id = f"{i:032x}"
    spans = [(1, trace_id, f"{i:08x}{j:08x}", "", f"span {j}", "x" * (i % 50)) for j in range(size)]
    calls = [(1, trace_id, f"{i:08x}{0:08x}", "client")] if i % 2 else []
    return (1, spans, calls, [trace_id])


def make(path, **kw) -> Spool:
    kw.setdefault("max_bytes", BIG)
    kw.setdefault("segment_bytes", 64 * 1024 * 1024)
    return Spool(path, **kw)


def read_all(spool: Spool, start=None, batch: int = 7):
    """Every record from `start` (default: the checkpoint) to the end, reading `batch` at a time."""
    position = spool.checkpoint if start is None else start
    out = []
    while True:
        records, position = spool.read_from(position, max_records=batch)
        if not records:
            return out, position
        assert len(records) <= batch
        out.extend(records)


def segment_files(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).iterdir() if p.name.startswith("seg-"))


# -- basics ----------------------------------------------------------------------------------------
def test_append_read_commit_round_trip(tmp_path):
    spool = make(tmp_path)
    assert spool.pending_bytes == 0
    appended = [spool.append(record(i)) for i in range(25)]
    assert appended == sorted(appended) and len(set(appended)) == 25
    got, end = read_all(spool)
    assert [r for _, r in got] == [record(i) for i in range(25)]
    assert [p for p, _ in got] == appended  # append returns the record's position
    # Reading again from the same place gives the same thing (nothing is consumed until commit).
    again, end2 = read_all(spool, batch=100)
    assert again == got and end2 == end
    assert spool.read_from(end, max_records=10)[0] == []
    spool.commit(end)
    assert spool.checkpoint == end
    assert spool.pending_bytes == 0
    assert read_all(spool)[0] == []
    spool.close()


def test_read_from_any_returned_position_resumes_there(tmp_path):
    spool = make(tmp_path)
    positions = [spool.append(record(i)) for i in range(10)]
    for k, position in enumerate(positions):
        got, _ = read_all(spool, start=position)
        assert [r for _, r in got] == [record(i) for i in range(k, 10)]
    records, after_three = spool.read_from(spool.checkpoint, max_records=3)
    assert len(records) == 3 and after_three == positions[3]
    spool.close()


def test_records_appended_after_a_read_are_seen_by_the_next_read(tmp_path):
    spool = make(tmp_path)
    spool.append(record(0))
    got, position = read_all(spool)
    assert len(got) == 1
    spool.append(record(1))
    spool.append(record(2))
    more, _ = read_all(spool, start=position)
    assert [r for _, r in more] == [record(1), record(2)]
    spool.close()


def test_records_survive_close_and_reopen(tmp_path):
    spool = make(tmp_path)
    for i in range(12):
        spool.append(record(i, size=i % 5))
    pending = spool.pending_bytes
    spool.close()

    reopened = make(tmp_path)
    assert reopened.pending_bytes == pending
    got, _ = read_all(reopened)
    assert [r for _, r in got] == [record(i, size=i % 5) for i in range(12)]
    reopened.close()


def test_checkpoint_survives_reopen_and_only_the_rest_is_replayed(tmp_path):
    spool = make(tmp_path)
    positions = [spool.append(record(i)) for i in range(10)]
    spool.commit(positions[6])  # records 0..5 are in ClickHouse
    pending = spool.pending_bytes
    spool.close()

    reopened = make(tmp_path)
    assert reopened.checkpoint == positions[6]
    assert reopened.pending_bytes == pending > 0
    got, end = read_all(reopened)
    assert [r for _, r in got] == [record(i) for i in range(6, 10)]
    # New appends go after the old ones.
    reopened.append(record(10))
    got, _ = read_all(reopened)
    assert [r for _, r in got] == [record(i) for i in range(6, 11)]
    reopened.close()


def test_a_crash_without_close_keeps_every_appended_record(tmp_path):
    """append() returns once the record is durable: no close() needed (SIGKILL right after the ack)."""
    spool = make(tmp_path)
    for i in range(5):
        spool.append(record(i))
    # Simulate the process dying: a second Spool on the same directory, the first never closed.
    other = make(tmp_path)
    got, _ = read_all(other)
    assert [r for _, r in got] == [record(i) for i in range(5)]
    other.close()
    spool.close()


# -- torn and corrupt tails ------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 3, 8, 20])
def test_torn_tail_frame_is_cut_off_on_reopen(tmp_path, cut):
    spool = make(tmp_path)
    for i in range(5):
        spool.append(record(i))
    spool.close()
    last = segment_files(tmp_path)[-1]
    size = last.stat().st_size
    with open(last, "r+b") as f:
        f.truncate(size - cut)

    reopened = make(tmp_path)
    got, _ = read_all(reopened)
    assert [r for _, r in got] == [record(i) for i in range(4)]
    # The spool keeps working: a new record lands right after the good ones and is readable.
    reopened.append(record(99))
    got, end = read_all(reopened)
    assert [r for _, r in got] == [record(i) for i in range(4)] + [record(99)]
    reopened.commit(end)
    assert reopened.pending_bytes == 0
    reopened.close()

    # ... and again after another reopen.
    third = make(tmp_path)
    assert read_all(third)[0] == []
    third.close()


@pytest.mark.parametrize(
    "garbage",
    [b"\x00", b"garbage that is not a frame", bytes(64), os.urandom(300), b"LOS1" + b"\xff" * 8],
    ids=["one-byte", "text", "zeros", "random", "magic-then-junk"],
)
def test_garbage_after_the_last_frame_is_cut_off_on_reopen(tmp_path, garbage):
    spool = make(tmp_path)
    for i in range(5):
        spool.append(record(i))
    spool.close()
    with open(segment_files(tmp_path)[-1], "ab") as f:
        f.write(garbage)

    reopened = make(tmp_path)
    reopened.append(record(5))
    got, _ = read_all(reopened)
    assert [r for _, r in got] == [record(i) for i in range(6)]
    reopened.close()


def test_torn_tail_is_cut_after_a_partly_committed_spool(tmp_path):
    spool = make(tmp_path)
    positions = [spool.append(record(i)) for i in range(6)]
    spool.commit(positions[3])
    spool.close()
    last = segment_files(tmp_path)[-1]
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size - 2)
    reopened = make(tmp_path)
    got, end = read_all(reopened)
    assert [r for _, r in got] == [record(3), record(4)]
    reopened.commit(end)
    assert reopened.pending_bytes == 0
    reopened.close()


# -- segments --------------------------------------------------------------------------------------
def test_segments_rotate_and_consumed_ones_are_deleted_after_commit(tmp_path):
    spool = make(tmp_path, segment_bytes=2000)
    positions = [spool.append(record(i, size=4)) for i in range(60)]
    files = segment_files(tmp_path)
    assert len(files) >= 5, "a tiny segment size must rotate"
    assert len({p[0] for p in positions}) == len(files)

    got, end = read_all(spool)  # reads across every segment boundary
    assert [r for _, r in got] == [record(i, size=4) for i in range(60)]

    # Commit a position in the middle: the segments wholly before it go away, the rest stays readable.
    middle = positions[30]
    spool.commit(middle)
    remaining = segment_files(tmp_path)
    assert len(remaining) < len(files)
    assert all(int(p.name[4:16]) >= middle[0] for p in remaining if p.name[4:16].isdigit())
    got, _ = read_all(spool)
    assert [r for _, r in got] == [record(i, size=4) for i in range(30, 60)]

    spool.commit(end)
    assert spool.pending_bytes == 0
    assert len(segment_files(tmp_path)) <= 2  # at most the current segment (and the one the checkpoint is in)
    spool.append(record(60, size=4))
    got, _ = read_all(spool)
    assert [r for _, r in got] == [record(60, size=4)]
    spool.close()


def test_rotated_spool_reopens_with_the_same_pending_records(tmp_path):
    spool = make(tmp_path, segment_bytes=1500)
    positions = [spool.append(record(i, size=4)) for i in range(40)]
    spool.commit(positions[17])
    pending = spool.pending_bytes
    spool.close()
    reopened = make(tmp_path, segment_bytes=1500)
    assert reopened.pending_bytes == pending
    got, end = read_all(reopened)
    assert [r for _, r in got] == [record(i, size=4) for i in range(17, 40)]
    reopened.commit(end)
    assert reopened.pending_bytes == 0
    reopened.close()


def test_torn_tail_in_the_newest_of_several_segments(tmp_path):
    spool = make(tmp_path, segment_bytes=1500)
    for i in range(30):
        spool.append(record(i, size=4))
    spool.close()
    last = segment_files(tmp_path)[-1]
    assert len(segment_files(tmp_path)) > 1
    with open(last, "ab") as f:
        f.write(b"\x01\x02torn")
    reopened = make(tmp_path, segment_bytes=1500)
    reopened.append(record(30, size=4))
    got, _ = read_all(reopened)
    assert [r for _, r in got] == [record(i, size=4) for i in range(31)]
    reopened.close()


# -- accounting and limits -------------------------------------------------------------------------
def test_pending_bytes_accounting(tmp_path):
    spool = make(tmp_path, segment_bytes=3000)
    sizes = []
    positions = []
    for i in range(30):
        before = spool.pending_bytes
        positions.append(spool.append(record(i, size=1 + i % 4)))
        sizes.append(spool.pending_bytes - before)
        assert sizes[-1] > 0
    total = spool.pending_bytes
    assert total == sum(sizes)
    # Committing the position of record k frees exactly the bytes of records 0..k-1.
    for k in (1, 5, 11, 12, 29):
        spool.commit(positions[k])
        assert spool.pending_bytes == sum(sizes[k:]), k
    _, end = read_all(spool)
    spool.commit(end)
    assert spool.pending_bytes == 0
    spool.close()
    assert make(tmp_path, segment_bytes=3000).pending_bytes == 0


def test_spool_full_refuses_appends_until_the_consumer_commits(tmp_path):
    spool = make(tmp_path, max_bytes=20_000, segment_bytes=4000)
    accepted = []
    with pytest.raises(SpoolFull):
        for i in range(10_000):
            spool.append(record(i, size=3))
            accepted.append(i)
    assert 0 < len(accepted) < 10_000
    assert spool.pending_bytes <= 20_000
    # A refused append leaves nothing behind, and refuses again while still full.
    with pytest.raises(SpoolFull):
        spool.append(record(-1, size=3))
    got, end = read_all(spool)
    assert [r for _, r in got] == [record(i, size=3) for i in accepted]
    spool.commit(end)
    assert spool.pending_bytes == 0
    spool.append(record(10_001))  # room again
    got, _ = read_all(spool)
    assert [r for _, r in got] == [record(10_001)]
    spool.close()


def test_spool_full_counts_what_is_pending_after_a_reopen(tmp_path):
    spool = make(tmp_path, max_bytes=20_000)
    with pytest.raises(SpoolFull):
        while True:
            spool.append(record(1, size=3))
    spool.close()
    reopened = make(tmp_path, max_bytes=20_000)
    with pytest.raises(SpoolFull):
        reopened.append(record(2, size=3))
    reopened.close()


# -- concurrency -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fsync", [True, False])
def test_concurrent_appends_land_exactly_once(tmp_path, fsync):
    spool = make(tmp_path, segment_bytes=20_000, fsync=fsync)
    threads, per_thread = 8, 40
    returned: dict[int, list] = {t: [] for t in range(threads)}
    errors = []
    start = threading.Barrier(threads)

    def worker(t):
        try:
            start.wait()
            rng = random.Random(t)
            for n in range(per_thread):
                rec = (t, [(t, n, "y" * rng.randint(0, 300))], [], [f"{t:016x}{n:016x}"])
                returned[t].append((spool.append(rec), rec))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors
    got, end = read_all(spool, batch=50)
    assert len(got) == threads * per_thread
    by_position = dict(got)
    assert len(by_position) == len(got)  # distinct positions
    for t in range(threads):
        for position, rec in returned[t]:
            assert by_position[position] == rec  # each append's position holds exactly its record
        # One thread's appends keep their order.
        order = [p for p, _ in returned[t]]
        assert order == sorted(order)
    spool.close()
    reopened = make(tmp_path, segment_bytes=20_000)
    again, _ = read_all(reopened, batch=50)
    assert again == got
    reopened.close()


def test_reader_concurrent_with_writers_sees_every_record_once(tmp_path):
    """The writer thread reads and commits while exports append (the platform's steady state)."""
    spool = make(tmp_path, segment_bytes=5000)
    total, producers = 300, 3
    done = threading.Event()
    seen = []

    def produce(t):
        for n in range(total // producers):
            spool.append((t, [(t, n)], [], [f"{t}-{n}"]))

    def consume():
        position = spool.checkpoint
        while True:
            records, next_position = spool.read_from(position, max_records=16)
            if records:
                seen.extend(r for _, r in records)
                spool.commit(next_position)
                position = next_position
            elif done.is_set():
                records, _ = spool.read_from(position, max_records=16)
                if not records:
                    return
            else:
                threading.Event().wait(0.002)

    consumer = threading.Thread(target=consume)
    consumer.start()
    workers = [threading.Thread(target=produce, args=(t,)) for t in range(producers)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    done.set()
    consumer.join(60)
    assert sorted(seen) == sorted((t, [(t, n)], [], [f"{t}-{n}"]) for t in range(producers)
                                  for n in range(total // producers))
    assert spool.pending_bytes == 0
    spool.close()
