"""Keeps `llm_requests` current: traces touched by ingest are decomposed again from everything stored for them.

Because a trace is always rebuilt from all of its stored spans, the rows do not
depend on the order or batching in which the spans arrived. Rows whose key moved
(a late span changed the anchor or the start day) are cancelled with is_deleted.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from pathlib import Path

from collectors.base import CALL_SPAN_NAMES, SPAN_KIND_CLIENT, LLMCall, Role

from . import joins, metrics
from .backlog import DecompositionBacklog
from .decomposition import RequestRecord, decompose_trace
from .os_threads import name_os_thread
from .rollups import record_touches
from .row_encoding import bulk_insert_settings, encode_rows
from .store import ClickHouseStore, StoreUnavailable, string_set
from .trace_filter import TRACE_HASH_SQL, TraceFilter

log = logging.getLogger(__name__)

REQUEST_COLUMNS = (
    "project_id", "trace_id", "request_key", "request_id", "start_time", "service", "model", "engine_config",
    "prompt_tokens", "completion_tokens", "prompt_bucket", "e2e_ms", "ttft_ms", "engine_ttft_ms", "tpot_ms",
    "network_ms", "network_client_gateway_ms", "network_gateway_engine_ms", "overhead_ms", "queue_ms",
    "prefill_ms", "decode_ms", "hops", "status", "version", "is_deleted", "retention_days", "replica_group",
    "gateway_ms", "joined_by", "linked_trace_ids", "gateway", "cached_prompt_tokens", "served_from", "lookup_ms",
)

_CALL_FIELDS = (
    "trace_id, span_id, parent_span_id, role, convention, service, name, start_ns, end_ns, model, request_id, "
    "prompt_tokens, completion_tokens, streaming, is_error, ttft_ms, engine_e2e_ms, queue_ms, prefill_ms, "
    "decode_ms, inference_ms, engine_config, retention_days, replica_group, cached_prompt_tokens, served_from, "
    "lookup_ms"
)
_CHUNK = 5000
# collectors.base.CALL_SPAN_NAMES in SQL (span kind CLIENT, or LiteLLM's call spans by name).
_CALL_SPAN_SQL = (f"kind = {SPAN_KIND_CLIENT} OR name IN ("
                  + ", ".join(f"'{name}'" for name in sorted(CALL_SPAN_NAMES)) + ")")
_NS_PER_HOUR = 3_600 * 1_000_000_000
# Joins across traces: rounds of partner lookups (a partner's own loose ends lead to more), and at most this many
# partner traces per chunk (a component longer than joins.MAX_CHAIN is never joined anyway).
_JOIN_ROUNDS = 3
_MAX_JOIN_TRACES = 2_000


def _call_from_row(row) -> tuple[LLMCall, int]:
    (trace_id, span_id, parent, role, convention, service, name, start_ns, end_ns, model, request_id, prompt,
     completion, streaming, is_error, ttft, e2e, queue, prefill, decode, inference, engine_config, retention,
     replica_group, cached, served_from, lookup_ms) = row
    call = LLMCall(
        trace_id=trace_id, span_id=span_id, parent_span_id=parent, role=Role(role), convention=convention,
        service=service, name=name, start_ns=start_ns, end_ns=end_ns, model=model, request_id=request_id,
        prompt_tokens=prompt, completion_tokens=completion, streaming=None if streaming is None else bool(streaming),
        is_error=bool(is_error), ttft_ms=ttft, engine_e2e_ms=e2e, queue_ms=queue, prefill_ms=prefill,
        decode_ms=decode, inference_ms=inference, engine_config=engine_config, replica_group=replica_group,
        cached_prompt_tokens=cached, served_from=served_from, lookup_ms=lookup_ms,
    )
    return call, retention


def _us_text(us: int) -> str:
    return f"{us // 1_000_000}.{us % 1_000_000:06d}"


def request_row(project_id: int, record: RequestRecord, version: int, retention_days: int) -> list:
    us = record.start_ns // 1000
    return [
        project_id, record.trace_id, record.request_key, record.request_id or "", f"{us // 1_000_000}.{us % 1_000_000:06d}",
        record.service, record.model or "", record.engine_config or "", record.prompt_tokens,
        record.completion_tokens, record.prompt_bucket, record.e2e_ms, record.ttft_ms, record.engine_ttft_ms,
        record.tpot_ms, record.network_ms, record.network_client_gateway_ms, record.network_gateway_engine_ms,
        record.overhead_ms, record.queue_ms, record.prefill_ms, record.decode_ms,
        # Stored as JSON text in a String column (ClickHouse writes arrays into String as their JSON).
        [_hop_json(hop) for hop in record.hops],
        record.status, version, 0, retention_days, record.replica_group or "", record.gateway_ms,
        record.joined_by, record.linked_trace_ids,
        " > ".join([hop.service for hop in record.hops if hop.role == "gateway"]),
        record.cached_prompt_tokens, record.served_from, record.lookup_ms,
    ]


def _hop_json(hop) -> dict:
    item = {
        "role": hop.role, "span_id": hop.span_id, "service": hop.service, "convention": hop.convention,
        "name": hop.name, "start_ns": hop.start_ns, "duration_ms": hop.duration_ms, "ttft_ms": hop.ttft_ms,
        "network_ms": hop.network_ms, "unattributed_ms": hop.unattributed_ms, "processing_ms": hop.processing_ms,
    }
    if hop.trace_id is not None:  # a row joined across traces: each hop's own trace
        item["trace_id"] = hop.trace_id
    return item


def tombstone_row(project_id: int, trace_id: str, request_key: str, start_us: int, version: int) -> list:
    return [project_id, trace_id, request_key, "", _us_text(start_us), "", "", "", None, None, "", None, None, None,
            None, None, None, None, None, None, None, None, [], "", version, 1, 1, "", None, "", [], "", None, "engine",
            None]


class _Trace:
    """What the memory holds of one trace."""

    __slots__ = ("calls", "parents", "times", "retention_days", "complete", "rows")

    def __init__(self, retention_days: int, complete: bool):
        self.calls: dict[str, LLMCall] = {}
        self.parents: dict[str, str] = {}
        self.times: dict[str, tuple[int, int]] = {}  # call spans (collectors.base.CALL_SPAN_NAMES): start, end
        self.retention_days = retention_days
        # Every stored span of the trace is here: the trace was new to the store when its first spans
        # were written (TraceFilter, one writing process) and nothing of it has been forgotten since.
        self.complete = complete
        # The (request_key, start µs) of its live request rows, as this process last wrote them; None
        # when unknown (then they are read from ClickHouse).
        self.rows: set[tuple[str, int]] | None = set() if complete else None


class TraceMemory:
    """LLM calls and parent links of recently written traces, so a rebuild need not read them back.

    An entry is trusted without asking ClickHouse when it is `complete` (see _Trace); otherwise only
    when ClickHouse holds exactly as many spans of the trace as the memory does (spans from before a
    restart, or written by another ingest process, make the counts differ and the trace is read from
    ClickHouse).
    """

    # ~0.5-1.5 KB a trace. Enough for the decomposition to fall ~15 s behind a 30k spans/s burst: an
    # entry forgotten before its trace is decomposed sends it down the slow path (three lookups), which
    # costs most when the platform is already behind (at 50,000, ~7% of a 400k-span burst did).
    def __init__(self, max_traces: int = 150_000):
        self.max_traces = max_traces
        self._traces: OrderedDict[tuple[int, str], _Trace] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, project_id: int, retention_days: int, calls: list[LLMCall],
            edges: tuple[list[str], list[str], list[str]], new_traces=frozenset(),
            call_times: dict[str, dict[str, tuple[int, int]]] | None = None) -> None:
        """Remember these spans, given as (trace ids, span ids, parent span ids), one item per span;
        `new_traces` are the trace ids the store held nothing of before them."""
        with self._lock:
            traces = self._traces
            # The spans of one trace come several per batch: look each trace up in the LRU once.
            batch: dict[str, _Trace] = {}
            for trace_id, span_id, parent in zip(*edges):
                entry = batch.get(trace_id)
                if entry is None:
                    key = (project_id, trace_id)
                    entry = traces.get(key)
                    if entry is None:
                        entry = traces[key] = _Trace(retention_days, trace_id in new_traces)
                    else:
                        traces.move_to_end(key)
                    batch[trace_id] = entry
                entry.parents[span_id] = parent
            for call in calls:
                entry = batch.get(call.trace_id)
                if entry is not None:
                    entry.calls[call.span_id] = call
            if call_times:
                for trace_id, times in call_times.items():
                    entry = batch.get(trace_id)
                    if entry is not None:
                        entry.times.update(times)
            while len(traces) > self.max_traces:
                traces.popitem(last=False)

    def __len__(self) -> int:
        return len(self._traces)

    def get(self, project_id: int, trace_id: str) -> _Trace | None:
        with self._lock:
            return self._traces.get((project_id, trace_id))

    def get_many(self, project_id: int, trace_ids: list[str]) -> dict[str, _Trace]:
        """{trace_id: entry} for the traces remembered (one lock hold for a whole rebuild chunk)."""
        with self._lock:
            get = self._traces.get
            found = {}
            for trace_id in trace_ids:
                entry = get((project_id, trace_id))
                if entry is not None:
                    found[trace_id] = entry
            return found


def rebuild_traces(store: ClickHouseStore, project_id: int, trace_ids: list[str], memory: TraceMemory | None = None) -> int:
    """Decompose these traces again from what is stored; returns the number of request rows written."""
    written = 0
    for start in range(0, len(trace_ids), _CHUNK):
        chunk = trace_ids[start : start + _CHUNK]
        written += _rebuild_chunk(store, project_id, chunk, memory)
    return written


def _from_memory(store: ClickHouseStore, project_id: int, entries: dict[str, _Trace]) -> dict[str, _Trace]:
    """The entries that hold every stored span of their trace: the complete ones, and the others whose
    span count ClickHouse confirms.

    The span-count lookup is the costly part: `spans` is ordered by trace id, so it touches one
    granule per trace id and part, i.e. the whole project's `trace_id` column once the store holds
    more than ~5,000 granules' worth of spans (~0.8 s of CPU per 5,000 traces at 10 million spans;
    `ingest.bench --preload-traces`). Complete entries (new traces, see TraceFilter)
    need none."""
    trusted = {t: e for t, e in entries.items() if e.complete}
    check = sorted(t for t, e in entries.items() if not e.complete)
    if trusted:
        metrics.DECOMPOSE_TRACE_SOURCES.labels("memory").inc(len(trusted))
    if not check:
        return trusted
    in_traces, traces = string_set("traces", check)
    # count(), not uniqExact(span_id): a span stored twice (a spool replay) only makes the counts differ,
    # and the trace is then read from ClickHouse, which is always right; counting is ~20% cheaper.
    stored = store.query_json(
        f"SELECT trace_id, count() FROM {store.table('spans')} "
        f"WHERE project_id = {{project_id:UInt32}} AND trace_id IN {in_traces} GROUP BY trace_id",
        project_id=project_id, parameters={"traces": traces},
    )
    confirmed = 0
    for t, count in stored:
        if count == len(entries[t].parents):
            trusted[t] = entries[t]
            confirmed += 1
    if confirmed:
        metrics.DECOMPOSE_TRACE_SOURCES.labels("memory_checked").inc(confirmed)
    return trusted


def _read_traces(store: ClickHouseStore, project_id: int, trace_ids: list[str], remembered: dict[str, _Trace]):
    """(calls, parents, call span times, retention days), each by trace id, of these traces: from the memory
    for the `remembered` ones, from ClickHouse for the others."""
    calls_by_trace: dict[str, list[LLMCall]] = defaultdict(list)
    retention: dict[str, int] = {}
    parents_by_trace: dict[str, dict[str, str]] = defaultdict(dict)
    times_by_trace: dict[str, dict[str, tuple[int, int]]] = defaultdict(dict)
    for trace_id in trace_ids:
        entry = remembered.get(trace_id)
        if entry is not None and entry.calls:
            calls_by_trace[trace_id] = list(entry.calls.values())
            parents_by_trace[trace_id] = entry.parents
            if entry.times:
                times_by_trace[trace_id] = entry.times
            retention[trace_id] = entry.retention_days
    to_read = [t for t in trace_ids if t not in remembered]
    if to_read:
        metrics.DECOMPOSE_TRACE_SOURCES.labels("store").inc(len(to_read))
    in_traces, traces = string_set("traces", to_read)
    for row in store.query_json(
        f"SELECT {_CALL_FIELDS} FROM {store.table('llm_calls')} FINAL "
        f"WHERE project_id = {{project_id:UInt32}} AND trace_id IN {in_traces}",
        project_id=project_id, parameters={"traces": traces},
    ) if to_read else ():
        call, days = _call_from_row(row)
        calls_by_trace[call.trace_id].append(call)
        retention[call.trace_id] = max(retention.get(call.trace_id, 0), days)
    read_edges = [t for t in to_read if t in calls_by_trace]
    if read_edges:
        in_traces, traces = string_set("traces", read_edges)
        # The call spans' times too (the same spans the ingest memo keeps: collectors.base.CALL_SPAN_NAMES),
        # so a trace decomposed from the store splits gateway processing as one decomposed from memory.
        for trace_id, span_id, parent, start_ns, end_ns in store.query_json(
            f"SELECT trace_id, span_id, parent_span_id, "
            f"if({_CALL_SPAN_SQL}, toUnixTimestamp64Nano(start_time), 0), "
            f"if({_CALL_SPAN_SQL}, toUnixTimestamp64Nano(end_time), 0) FROM {store.table('spans')} "
            f"WHERE project_id = {{project_id:UInt32}} AND trace_id IN {in_traces}",
            project_id=project_id, parameters={"traces": traces},
        ):
            parents_by_trace[trace_id][span_id] = parent
            if end_ns:
                times_by_trace[trace_id][span_id] = (int(start_ns), int(end_ns))
    return calls_by_trace, parents_by_trace, times_by_trace, retention


def _loose_keys(records: list[RequestRecord], calls: list[LLMCall]) -> list[tuple[str, int]]:
    """(correlation key, start ns) of the loose ends of one trace's rows (traces/joins.py): rows without an engine
    hop, or without a client on top. Complete rows (the usual case) cost two comparisons."""
    out = []
    by_span = None
    for record in records:
        hops = record.hops
        if not hops or (hops[0].role == "client" and hops[-1].role == "engine"):
            continue
        if by_span is None:
            by_span = {call.span_id: call for call in calls}
        for piece in joins.pieces_of(record.trace_id, [record], by_span):
            if piece.outer_key is not None:
                out.append((piece.outer_key, record.start_ns))
            out.extend((key, record.start_ns) for key in piece.inner_keys)
    return out


def _join_partners(store: ClickHouseStore, project_id: int, keys: list[tuple[str, int]], known) -> list[str]:
    """The traces, other than `known`, holding an LLM call with one of these correlation keys near its time."""
    if not keys:
        return []
    window = joins.JOIN_WINDOW_NS
    lo = min(start for _, start in keys) - window
    hi = max(start for _, start in keys) + window
    in_ids, ids = string_set("ids", joins.lookup_values({key for key, _ in keys}))
    found = store.query_json(
        f"SELECT DISTINCT trace_id FROM {store.table('llm_calls')} "
        f"WHERE project_id = {{project_id:UInt32}} AND request_id IN {in_ids} "
        "AND start_ns BETWEEN {lo:Int64} AND {hi:Int64}",
        project_id=project_id, parameters={"ids": ids, "lo": lo, "hi": hi},
    )
    metrics.JOIN_LOOKUPS.inc()
    return sorted({row[0] for row in found} - set(known))


def _rebuild_chunk(store: ClickHouseStore, project_id: int, trace_ids: list[str], memory: TraceMemory | None = None) -> int:
    entries = memory.get_many(project_id, trace_ids) if memory is not None else {}
    remembered = _from_memory(store, project_id, entries) if entries else {}
    calls_by_trace, parents_by_trace, times_by_trace, retention = _read_traces(store, project_id, trace_ids, remembered)
    records_by_trace: dict[str, list[RequestRecord]] = {}
    loose: list[str] = []  # traces with rows that could join others'

    def decompose(ids: list[str]) -> list[tuple[str, int]]:
        """Decompose these traces (those with calls) into records_by_trace; the correlation keys of their rows'
        loose ends, their traces noted in `loose`."""
        keys = []
        for trace_id in ids:
            calls = calls_by_trace.get(trace_id)
            if calls:
                records = records_by_trace[trace_id] = decompose_trace(calls, parents_by_trace.get(trace_id, {}),
                                                                       times_by_trace.get(trace_id))
                found = _loose_keys(records, calls)
                if found:
                    keys.extend(found)
                    loose.append(trace_id)
        return keys

    keys = decompose(sorted(calls_by_trace))
    # Joins across broken propagation (traces/joins.py): the other traces holding the loose ends' ids, and theirs
    # in turn, are decomposed with these, so that a join is the same whichever of its traces was rebuilt.
    extra: list[str] = []
    rounds = 0
    while keys and rounds < _JOIN_ROUNDS and len(extra) < _MAX_JOIN_TRACES:
        rounds += 1
        partners = _join_partners(store, project_id, keys, records_by_trace)[: _MAX_JOIN_TRACES - len(extra)]
        if not partners:
            break
        extra.extend(partners)
        if memory is not None:
            more = memory.get_many(project_id, partners)
            entries.update(more)
            remembered.update(_from_memory(store, project_id, more) if more else {})
        more_calls, more_parents, more_times, more_retention = _read_traces(store, project_id, partners, remembered)
        calls_by_trace.update(more_calls)
        parents_by_trace.update(more_parents)
        times_by_trace.update(more_times)
        retention.update(more_retention)
        keys = decompose(partners)
    if len(loose) > 1:  # the pieces of one call may also have come together, in this chunk
        traces = {t: (calls_by_trace[t], parents_by_trace.get(t, {}), times_by_trace.get(t)) for t in loose}
        joined_traces = joins.join_traces(traces, {t: records_by_trace[t] for t in loose})
        records_by_trace.update(joined_traces)
        joined = sum(1 for records in joined_traces.values() for record in records if record.joined_by)
        if joined:
            metrics.JOINED_REQUESTS.inc(joined)
        for trace_id, records in joined_traces.items():
            for record in records:
                if record.linked_trace_ids:  # a joined row keeps the longest retention of its traces
                    retention[trace_id] = max([retention.get(trace_id, 1)]
                                              + [retention.get(t, 1) for t in record.linked_trace_ids])
    trace_ids = trace_ids + extra
    # The rows stored for these traces, to cancel those whose key a late span moved. Not FINAL (about 3x
    # the CPU here): an older version of a row still live, or of one already cancelled, can come back
    # too, and cancelling a row twice, or a row the new rows replace anyway, changes nothing.
    # Traces whose live rows this process wrote itself (their memory entry knows them) need no lookup.
    previous: dict[str, set[tuple[str, int]]] = defaultdict(set)
    unknown = []
    for trace_id in trace_ids:
        entry = entries.get(trace_id)
        if entry is None or entry.rows is None:
            unknown.append(trace_id)
        elif entry.rows:
            previous[trace_id] = set(entry.rows)
    in_traces, traces = string_set("traces", unknown)
    for trace_id, key, start_us in store.query_json(
        f"SELECT trace_id, request_key, toUnixTimestamp64Micro(start_time) FROM {store.table('llm_requests')} "
        f"WHERE project_id = {{project_id:UInt32}} AND trace_id IN {in_traces} AND is_deleted = 0",
        project_id=project_id, parameters={"traces": traces},
    ) if unknown else ():
        previous[trace_id].add((key, start_us))
    with_calls = sorted(t for t, records in records_by_trace.items() if records)
    version = time.time_ns()
    rows = []
    add_row = rows.append
    hours: set[int] = set()  # hours (since the epoch) whose rollups these rows change
    add_hour = hours.add
    no_records: list[RequestRecord] = []
    live: dict[str, set[tuple[str, int]]] = {}  # the rows each remembered trace has once these are written
    for trace_id in with_calls + [t for t in previous if t not in with_calls]:
        records = records_by_trace.get(trace_id, no_records)
        days = retention.get(trace_id, 1)
        if trace_id in entries:
            live[trace_id] = {(record.request_key, record.start_ns // 1000) for record in records}
        before = previous.get(trace_id)
        if before is None:  # the usual case: nothing stored for the trace yet
            for record in records:
                add_row(request_row(project_id, record, version, days))
                add_hour(record.start_ns // _NS_PER_HOUR)
            continue
        kept = set()
        for record in records:
            add_row(request_row(project_id, record, version, days))
            kept.add((record.request_key, record.start_ns // _NS_PER_HOUR))
            add_hour(record.start_ns // _NS_PER_HOUR)
        for key, start_us in before:
            add_hour(start_us // 3_600_000_000)
            # The sort key holds the hour: a row whose hour moved is another row, so cancel the old one.
            if (key, start_us // 3_600_000_000) not in kept:
                add_row(tombstone_row(project_id, trace_id, key, start_us, version))
    hours = {hour * 3600 for hour in hours}
    store.insert_encoded("llm_requests", REQUEST_COLUMNS, encode_rows(rows), "JSONCompactEachRow",
                         bulk_insert_settings(store.embedded))
    # After the rows, so a rollup built in between is seen as stale and built again.
    record_touches(store, project_id, hours, version)
    # Only now that they are stored: these are the trace's live rows (whatever else was there is cancelled).
    for trace_id, entry in entries.items():
        entry.rows = live.get(trace_id, set())
    return len(rows)


class RequestBuilder(threading.Thread):
    """Decomposes the traces the writer stored, oldest first, in bounded chunks (traces/backlog.py).

    A cycle starts every `interval` seconds and takes the backlog a chunk (at most `chunk_traces`
    traces) at a time until it is empty; between chunks it can stop. After each chunk the time up to
    which everything stored has been decomposed is kept in `<state_dir>/decomposed_until` (ClickHouse
    stamps `ingested_at`), so after a stop or a crash `recover` rebuilds only what came after it.
    """

    def __init__(self, store: ClickHouseStore, *, interval: float, state_dir: str | Path, schema=None,
                 project_ids=None, trace_window: float = 0.0, max_span_age: float = 7 * 86_400,
                 max_pending_traces: int = 100_000, chunk_traces: int = _CHUNK, insert_in_flight=None):
        """`trace_window` > 0: this is the only process writing spans to the store, and traces new to it
        are decomposed without lookups (see trace_filter); `max_span_age` is the ingest limit, which
        bounds how old a span written in the last `trace_window` seconds can be. `max_pending_traces`
        bounds the backlog (the writer waits beyond it); `insert_in_flight` is the writer's
        `insert_in_flight` (when its current insert started, ms), so the checkpoint never passes it."""
        super().__init__(name="request-builder", daemon=True)
        self.store = store
        self.interval = interval
        self.chunk_traces = chunk_traces
        self.state_path = Path(state_dir) / "decomposed_until"
        self.backlog = DecompositionBacklog(max_pending_traces)
        # Holds what the backlog may hold plus one writer batch of single-span traces, so that no waiting
        # trace leaves the memory before its turn (it would then be read back from ClickHouse, ~50x the
        # cost, when the decomposition is already behind).
        self.memory = TraceMemory(max_traces=max_pending_traces + 60_000)
        self.filter = TraceFilter(trace_window) if trace_window > 0 else None
        self.max_span_age = max_span_age
        self.schema = schema  # SchemaGate: migrations first
        self.project_ids = project_ids  # callable: projects to recover after a restart
        self.recovered = project_ids is None
        self.insert_in_flight = insert_in_flight or (lambda: None)
        self._wake = threading.Event()
        self._stop_event = threading.Event()
        self._cycle_lock = threading.Lock()  # one cycle at a time (the thread, or a test calling cycle())

    # called by the writer after each successful insert, with each record's in-memory memo (or None)
    def mark_written(self, items: list[tuple[tuple, tuple | None]], written_ms: int | None = None) -> None:
        """Queue what was written (`written_ms`: when its insert started) for decomposition; the memos go
        into the filter and the memory at the start of the next chunk (`_remember`): that work (~3 µs a
        span) then holds up this thread, not the writer, whose next insert waits for it."""
        self.backlog.add_written(items, time.time_ns() // 1_000_000 if written_ms is None else written_ms)

    def _remember(self, written: list[tuple[int, list[str], tuple]]) -> None:
        """Into the filter and the memory, in the order the records were written (the filter tells the
        traces new to the store from the first record that holds them): [(project id, trace ids, memo)]."""
        for project_id, trace_ids, memo in written:
            new = ()
            if self.filter is not None:
                seen = self.filter.check_and_add(project_id, trace_ids)
                if not seen.all():
                    new = {t for t, s in zip(trace_ids, seen.tolist()) if not s}
            calls, edges, retention_days, call_times = memo
            self.memory.add(project_id, retention_days, calls, edges, new, call_times)

    def mark_dirty(self, project_id: int, trace_ids) -> None:
        """Decompose these traces again (as if just written)."""
        now_ms = time.time_ns() // 1_000_000
        self.backlog.add_recovered(project_id, [(t, now_ms) for t in trace_ids])

    def watermark_ms(self) -> int | None:
        try:
            return int(self.state_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def recover(self, project_ids: list[int]) -> int:
        """Queue the traces whose LLM calls were stored after the last checkpoint (all of them when there
        is none), oldest first, in slices: the checkpoint moves as each slice is done."""
        since = self.watermark_ms() or 5000
        count = 0
        for project_id in project_ids:
            rows = self.store.query(
                "SELECT trace_id, toUnixTimestamp64Milli(min(ingested_at)) "
                f"FROM {self.store.table('llm_calls')} "
                "WHERE project_id = {project_id:UInt32} AND ingested_at >= fromUnixTimestamp64Milli({since:Int64}) "
                "GROUP BY trace_id",
                project_id=project_id, parameters={"since": since - 5000},
            )
            count += self.backlog.add_recovered(project_id, [(r[0], int(r[1])) for r in rows], self.chunk_traces)
        return count

    def pending_traces(self) -> int:
        """Traces waiting to be (re)decomposed or being decomposed, plus one while the recovery after a
        restart has not run yet."""
        return self.backlog.traces() + (0 if self.recovered else 1)

    def stop(self) -> None:
        """Stop at the next chunk boundary (what is left resumes from the checkpoint on the next start)."""
        self._stop_event.set()
        self._wake.set()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.recovered and self.backlog.idle():
                return True
            self._wake.set()
            time.sleep(0.01)
        return False

    def _prepare(self) -> None:
        """Schema first, then (once) the traces the last process left undecomposed — before any chunk
        can move the checkpoint past them."""
        if self.schema is not None:
            self.schema.ensure()
        if not self.recovered:
            count = self.recover(self.project_ids())
            if count:
                log.info("rebuilding %d traces ingested before the last stop", count)
            self.recovered = True

    def load_filter(self) -> int:
        """Put into the filter the traces with spans written in the last window before this process
        started (by the process before it); returns how many. Then traces new to the store can be told."""
        # A few minutes more than the window: ClickHouse stamps ingested_at with its own clock.
        since_ms = int((time.time() - self.filter.window - 300) * 1000)
        # A span written since then started at most max_span_age before it: that bounds the partitions read.
        oldest_ms = since_ms - int(self.max_span_age * 1000) - 3_600_000
        loaded = []
        for project_id in (self.project_ids() if self.project_ids is not None else []):
            loaded.append((project_id, self.store.query_uint64(
                f"SELECT DISTINCT {TRACE_HASH_SQL} FROM {self.store.table('spans')} "
                "WHERE project_id = {project_id:UInt32} AND start_time >= fromUnixTimestamp64Milli({oldest:Int64}) "
                "AND ingested_at >= fromUnixTimestamp64Milli({since:Int64})",
                project_id=project_id, parameters={"oldest": oldest_ms, "since": since_ms},
            )))
            if self._stop_event.is_set():
                return 0
        total = sum(len(hashes) for _, hashes in loaded)
        self.filter.reserve(total)
        for project_id, hashes in loaded:
            self.filter.load(project_id, hashes)
        self.filter.ready.set()
        return total

    def filter_state(self) -> str:
        if self.filter is None:
            return "off"
        return "ready" if self.filter.ready.is_set() else "loading"

    def _filter_loader(self) -> None:
        backoff = 1.0
        while not self._stop_event.is_set():
            try:
                if self.schema is not None:
                    self.schema.ensure()
                loaded = self.load_filter()
                if self._stop_event.is_set():
                    return
                log.info("trace filter ready: %d traces written in the last %.0fs", loaded, self.filter.window)
                return
            except Exception as exc:  # ClickHouse away: every trace is looked up meanwhile
                log.warning("trace filter not loaded yet (%s); retrying in %.0fs", exc, backoff)
                self._stop_event.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def run(self) -> None:
        name_os_thread(self.name)
        if self.filter is not None:
            self._loader = threading.Thread(target=self._filter_loader, name="trace-filter", daemon=True)
            self._loader.start()
        backoff = 0.5
        first = True
        started = time.monotonic()
        while not self._stop_event.is_set():
            if not first:
                # Cycles start every `interval`; a cycle that took longer is followed at once by the
                # next (sleeping a whole interval after it left the backlog growing under load).
                self._wake.wait(max(0.0, self.interval - (time.monotonic() - started)))
                self._wake.clear()
            first = False
            started = time.monotonic()
            try:
                self._prepare()
                self.cycle()
                backoff = 0.5
            except StoreUnavailable as exc:
                if self._stop_event.is_set():
                    break
                log.warning("request builder: ClickHouse unavailable (%s); retrying", exc)
                self._stop_event.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                first = True  # retry without waiting a whole interval
            except Exception:
                log.exception("request builder cycle failed; retrying")
                self._stop_event.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def cycle(self) -> int:
        """Decompose the backlog a chunk at a time until it is empty or the builder is stopping;
        returns the number of traces decomposed."""
        done = 0
        with self._cycle_lock:
            while True:
                step = self.step()
                if step is None:
                    break
                done += step
                if self._stop_event.is_set():
                    break
        if self.filter is not None:
            metrics.TRACE_FILTER_BYTES.set(self.filter.nbytes)
        return done

    def step(self) -> int | None:
        """One chunk: the oldest waiting traces, decomposed, their rows stored, the checkpoint moved.
        None when nothing waits."""
        chunk = self.backlog.take(self.chunk_traces)
        if chunk is None:
            return None
        started = time.perf_counter()
        try:
            self._remember(chunk.memos)
            chunk.memos = []  # in the memory now; a retry needs them no more
            for project_id in chunk.traces:
                rebuild_traces(self.store, project_id, chunk.trace_ids(project_id), self.memory)
        except BaseException:
            self.backlog.put_back(chunk)  # the unfinished work waits again, in its place
            raise
        complete = self.backlog.done(chunk)
        now = time.time()
        for batch in complete:
            for arrival in batch.arrivals:
                metrics.QUERYABLE_LAG_SECONDS.observe(max(0.0, now - arrival))
        self._checkpoint()
        metrics.DECOMPOSED_TRACES.inc(len(chunk))
        metrics.DECOMPOSE_SECONDS.observe(time.perf_counter() - started)
        return len(chunk)

    def _checkpoint(self) -> None:
        """Everything stored before the checkpoint is decomposed: the oldest batch not completely
        decomposed, or an insert in progress, or (neither) this moment, read before both."""
        candidates = [time.time_ns() // 1_000_000]
        in_flight = self.insert_in_flight()
        if in_flight is not None:
            candidates.append(in_flight)
        oldest = self.backlog.oldest()
        if oldest is not None:
            candidates.append(oldest[0])
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(str(min(candidates)))
        tmp.replace(self.state_path)
