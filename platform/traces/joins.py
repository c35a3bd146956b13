"""Joins across broken trace propagation: one request whose hops landed in several traces.

A hop that does not pass `traceparent` on (LiteLLM by default, an OpenAI client instrumented by OpenInference
without an HTTP client instrumentation) splits one call into two traces: the application with its client span
(and LiteLLM's span) in one, the platform's gateway and the engine in another. Both sides record the same id:
the OpenAI response id the client got (`gen_ai.response.id`, `chatcmpl-…`) is the id vLLM logs as
`gen_ai.request.id` (completions: `cmpl-…-0` for the response `cmpl-…`), and the gateways in between pass it
back unchanged. This module joins such pieces into one request row, as if the trace had been propagated.

Pure Python, no Django. The request builder decomposes each trace alone first (traces/decomposition.py), takes
the loose ends of its rows (`pieces_of`), finds the other traces holding the same ids in ClickHouse, decomposes
them too, and calls `join_traces` over all of them.

Definitions
-----------
*Piece.* A request row of one trace that is not complete: it has no engine hop (an *upper* piece, keyed by the
id its innermost hop received, or when that hop records none the nearest hop above it: `outer_key`), or its outermost hop is not a client (a *lower* piece, keyed by the
ids its hops answered with: `inner_keys`). A gateway-only row (LiteLLM alone) is both. A row a gateway served from
its response cache is never an upper piece (it has no engine to find).

*Chain.* Pieces sharing a key form a component. It is joined only when it orders into one chain: the piece with
a client on top first, then by e2e, longest first (durations, not start times: the hosts' clocks differ), and
every consecutive pair (upper, lower) is a link: the upper one has no engine, the lower one's top is not a
client, the upper's `outer_key` is one of the lower's `inner_keys`, they belong to different traces and start
within `JOIN_WINDOW_NS` of each other. Anything else is ambiguous (two clients or two engines reporting one id,
a replayed trace) and nothing of the component is joined.

*Joined row.* The traces of the linked pieces are decomposed as one: the lower piece's top span gets the upper
piece's innermost hop as its parent, so the ordinary rules (hops, per-hop network and processing, the exact sum)
apply unchanged. The row belongs to the trace of its anchor (the engine's) and lists the others in
`linked_trace_ids`; `joined_by` is 'response_id' and each hop carries its own `trace_id`. The result depends only
on what is stored, whatever trace's rebuild found the partners, in whatever order the pieces arrived.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from collectors.base import LLMCall

from .decomposition import RequestRecord, decompose_trace

__all__ = ["JOIN_WINDOW_NS", "Piece", "join_traces", "lookup_values", "normalize_id", "pieces_of"]

# Pieces of one call start within this of each other (the upper one's start to the lower one's: the request's
# own duration plus clock skew; generous, because a join also needs the same id).
JOIN_WINDOW_NS = 15 * 60 * 1_000_000_000
# A component longer than this is not a chain of hops of one call.
MAX_CHAIN = 8
# Ids shorter than this are not taken as correlation ids (too likely to repeat).
MIN_ID_LENGTH = 8
JOINED_BY_RESPONSE_ID = "response_id"

# vLLM's completions endpoint logs `cmpl-<id>-<prompt index>` for the response `cmpl-<id>`.
_PROMPT_INDEX = re.compile(r"^(cmpl-.+)-\d+$")


def normalize_id(value: str | None) -> str | None:
    """The correlation key of a request or response id (None when it cannot serve as one)."""
    if not value or len(value) < MIN_ID_LENGTH:
        return None
    match = _PROMPT_INDEX.match(value)
    return match.group(1) if match else value


def lookup_values(keys: Iterable[str]) -> list[str]:
    """The stored `request_id` values a set of keys can take (a completions key also as `<key>-0`)."""
    values = set()
    for key in keys:
        values.add(key)
        if key.startswith("cmpl-"):
            values.add(key + "-0")
    return sorted(values)


@dataclasses.dataclass(slots=True)
class Piece:
    trace_id: str
    record: RequestRecord
    outer_key: str | None            # no engine hop: the id the innermost hop (else the nearest above) received
    inner_keys: frozenset[str]       # the top is not a client: the ids the hops answered with
    junction: str                    # span id of the innermost hop (a lower piece hangs under it)
    top: str                         # span id of the outermost hop

    @property
    def client_on_top(self) -> bool:
        return self.record.hops[0].role == "client"


def pieces_of(trace_id: str, records: list[RequestRecord], calls: Mapping[str, LLMCall]) -> list[Piece]:
    """The loose ends among one trace's rows. `calls`: span id -> LLM call of the trace."""
    pieces = []
    for record in records:
        hops = record.hops
        if not hops or record.joined_by:
            continue
        outer_key = None
        # A row served from a gateway's response cache has no engine to find: only a lower piece (its answer may
        # carry the id of the request that filled the cache, whose engine must not be joined under it).
        if hops[-1].role != "engine" and record.served_from == "engine":
            # The id the innermost hop received, else the nearest above it: gateways pass the upstream's response
            # id back unchanged, and some record none (LiteLLM's proxy span).
            for hop in reversed(hops):
                call = calls.get(hop.span_id)
                outer_key = normalize_id(call.request_id) if call is not None else None
                if outer_key is not None:
                    break
        inner_keys: frozenset[str] = frozenset()
        if hops[0].role != "client":
            keys = set()
            for hop in hops:
                call = calls.get(hop.span_id)
                key = normalize_id(call.request_id) if call is not None else None
                if key is not None:
                    keys.add(key)
            inner_keys = frozenset(keys)
        if outer_key is None and not inner_keys:
            continue
        pieces.append(Piece(trace_id, record, outer_key, inner_keys, hops[-1].span_id, hops[0].span_id))
    return pieces


def _chains(pieces: list[Piece], window_ns: int) -> list[list[Piece]]:
    """The components of pieces sharing keys that order into one chain (upper first); see the module docstring."""
    parent = list(range(len(pieces)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_with: dict[str, int] = {}
    for index, piece in enumerate(pieces):
        keys = set(piece.inner_keys)
        if piece.outer_key is not None:
            keys.add(piece.outer_key)
        for key in keys:
            other = first_with.setdefault(key, index)
            if other != index:
                parent[find(index)] = find(other)
    components: dict[int, list[Piece]] = {}
    for index, piece in enumerate(pieces):
        components.setdefault(find(index), []).append(piece)
    chains = []
    for members in components.values():
        if len(members) < 2 or len(members) > MAX_CHAIN:
            continue
        members.sort(key=lambda p: (not p.client_on_top, -p.record.e2e_ms, p.trace_id, p.record.request_key))
        if all(_links(upper, lower, window_ns) for upper, lower in zip(members, members[1:])):
            chains.append(members)
    return chains


def _links(upper: Piece, lower: Piece, window_ns: int) -> bool:
    return (upper.outer_key is not None and upper.outer_key in lower.inner_keys
            and upper.trace_id != lower.trace_id
            and abs(upper.record.start_ns - lower.record.start_ns) <= window_ns)


def join_traces(traces: Mapping[str, tuple[list[LLMCall], Mapping[str, str], Mapping[str, tuple[int, int]] | None]],
                records: dict[str, list[RequestRecord]], window_ns: int = JOIN_WINDOW_NS) -> dict[str, list[RequestRecord]]:
    """The rows of these traces with the pieces of one call joined; `traces`: trace id -> (calls, parents, call
    span times), `records`: each trace decomposed alone. Returns `records` itself when nothing joins, else a new
    dict (every trace of `records` a key, with [] for a trace left without rows)."""
    pieces: list[Piece] = []
    for trace_id, trace_records in records.items():
        data = traces.get(trace_id)
        if data is None:
            continue
        by_span = {call.span_id: call for call in data[0]}
        pieces.extend(pieces_of(trace_id, trace_records, by_span))
    if len(pieces) < 2:
        return records
    chains = _chains(pieces, window_ns)
    if not chains:
        return records
    # Traces decomposed together: those linked by a chain, transitively (an agent trace with several calls).
    group_of: dict[str, int] = {}
    groups: list[set[str]] = []
    for chain in chains:
        ids = {piece.trace_id for piece in chain}
        found = {group_of[t] for t in ids if t in group_of}
        if found:
            target = min(found)
            for other in found - {target}:
                for t in groups[other]:
                    group_of[t] = target
                groups[target] |= groups[other]
                groups[other] = set()
            groups[target] |= ids
        else:
            target = len(groups)
            groups.append(set(ids))
        for t in ids:
            group_of[t] = target
    links: dict[str, str] = {}  # lower piece's top span -> upper piece's innermost hop
    for chain in chains:
        for upper, lower in zip(chain, chain[1:]):
            links[lower.top] = upper.junction
    out = dict(records)
    for group in groups:
        if not group:
            continue
        calls: list[LLMCall] = []
        parents: dict[str, str] = {}
        times: dict[str, tuple[int, int]] = {}
        for trace_id in sorted(group):
            trace_calls, trace_parents, trace_times = traces[trace_id]
            calls.extend(trace_calls)
            parents.update(trace_parents)
            if trace_times:
                times.update(trace_times)
            out[trace_id] = []
        for call in calls:  # a call whose span never arrived in the parent map still has its own parent id
            parents.setdefault(call.span_id, call.parent_span_id)
        parents.update(links)
        trace_of = {call.span_id: call.trace_id for call in calls}
        for record in decompose_trace(calls, parents, times):
            hop_traces = {trace_of.get(hop.span_id, record.trace_id) for hop in record.hops}
            if len(hop_traces) > 1:
                record.joined_by = JOINED_BY_RESPONSE_ID
                record.linked_trace_ids = tuple(sorted(hop_traces - {record.trace_id}))
                for hop in record.hops:
                    hop.trace_id = trace_of.get(hop.span_id, record.trace_id)
            out.setdefault(record.trace_id, []).append(record)
    return out
