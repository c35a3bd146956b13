"""Latency decomposition: join the LLM calls of one trace into requests and split their latency.

Pure Python, no Django: ``decompose_trace(calls, parents)`` takes every `LLMCall`
known so far for ONE trace and the parent map of every span known in it, and returns
one `RequestRecord` per LLM request. It is a pure function of its inputs (the order of
``calls`` and of ``parents`` does not matter), so the ingest path simply recomputes a
trace whenever late spans arrive and overwrites the trace's rows.

Definitions
-----------
*LLM forest.* For each LLM call, its *LLM parent* is the nearest ancestor span that is
itself an LLM call, found by walking ``parents`` through any number of non-LLM spans
(HTTP client spans, framework spans). The parent of an LLM span is taken from
``parents`` and, if the span is not in it, from ``LLMCall.parent_span_id``. The walk
stops (no LLM parent) at a root (parent id ``''``), at a span missing from ``parents``
(not arrived yet: a later recomputation will see it) and inside a cycle of non-LLM
spans. A cycle made of LLM calls is cut at the call with the smallest span id (that
call gets no LLM parent), so every later walk terminates and the cut does not depend
on input order. If several records share a span id, one is kept deterministically
(highest role rank, then largest ``repr``).

Chain rules (how calls become requests)
---------------------------------------
1. Every ENGINE call anchors one request. From it, walk up the LLM forest, never past
   another ENGINE call (a request never extends above a different engine call). The
   nearest GATEWAY call on that walk is its first gateway hop. From a gateway hop the
   chain continues to the nearest GATEWAY ancestor of another service (same-service
   gateways are its wrappers, rule 4), passing over a CLIENT call only when it is that
   upper gateway's own call (a client of the upper gateway's service); any other CLIENT,
   an ENGINE or the root ends the chain. The nearest CLIENT call above the last gateway
   hop (or above the engine if the walk met no gateway) is its client hop. CLIENT calls
   passed over between the engine and its gateway (e.g. the gateway process's own
   instrumented SDK call to the engine) or between two gateways are *absorbed*.
2. A GATEWAY call that is not a hop of any engine request and is not absorbed (rule 4)
   anchors its own request (gateway -> external provider), with the nearest CLIENT
   above it as client hop. A CLIENT call that is not a hop of anything and is not
   absorbed anchors its own single-hop request.
3. Contention. When several requests want the same hop - a gateway that is the
   nearest gateway of several engine calls (retries, fallbacks, n>1 fan-out), or a
   client that is the nearest client of several requests (client-side retries) - the
   hop goes to the request whose current outermost hop ENDS LAST (the attempt whose
   answer came back), ties broken by the larger span id. Chains grow one gateway per
   round, every request at once, so contention is decided level by level. The losers stop growing:
   an engine that loses its gateway becomes an engine-only request (the engine is its
   outermost hop, its network_ms is NULL) and does not look for a client; a request
   that loses its client keeps its gateway as outermost hop.
4. Nested calls of one role in one service (two client instrumentations wrapping the same call,
   LangChain span around an OpenAI SDK span, LiteLLM router span around its
   deployment-call span) are one hop: the nearest one to the engine is the hop (rules
   1-2 always pick the nearest), and a call whose LLM parent has the same role makes
   that parent a *wrapper*. A wrapper that is not itself a hop of some request (its
   only possible "other claim") is absorbed. Engine calls are never merged: each is a
   separate unit of work of the engine and always anchors a request (rule 1).
   Absorbed calls belong to no row and do not affect any figure or the status.
5. Forwarded traceparent. A gateway that passes on the traceparent it received (LiteLLM's
   forward_traceparent_to_llm_provider) makes the next hop's span its sibling. Where rules 1
   and the chain walk look for the gateway above a hop (an engine without a gateway
   ancestor, or the next gateway of a chain), a gateway of another service with the same
   direct parent span that was in flight when the hop's span started comes first (the one
   that started last, ties to the larger span id; of two equal starts only the larger id is
   the upper one). Not "contains": LiteLLM closes its span on receiving the response, a
   moment before the next hop closes its own after sending it (seen on real runs).

Every LLM call therefore ends up as exactly one of: a hop of exactly one request, or
absorbed. Known limitation: a CLIENT call that is a leaf directly under a GATEWAY with
no engine below (a gateway's own instrumented SDK call to an external provider) is
indistinguishable from an application behind the gateway and anchors its own
client-only row next to the gateway's row.

Figures (docs/decomposition.md)
--------------------------------------------
The outermost hop is the client if present, else the gateway, else the engine. A hop's
e2e is its span duration, except the engine hop, whose e2e is ``engine_e2e_ms`` (vLLM
``gen_ai.latency.e2e``) when present, else its span duration.

- ``e2e_ms`` = outermost e2e; ``start_ns`` / ``service`` = the outermost hop's.
- ``queue_ms`` / ``prefill_ms`` / ``decode_ms`` from the engine call.
- ``overhead_ms`` = engine e2e - (queue + prefill + decode); NULL if any is NULL.
- Per hop, from the hop above (``Hop.network_ms`` / ``processing_ms`` / ``unattributed_ms``):
  below a client, all network (client e2e - hop e2e). Below a gateway that shows its call
  to this hop as a span (this hop's direct parent, a non-LLM span with known times in
  ``span_times`` or an absorbed client call of the gateway's service), the gateway's
  ``processing_ms`` = its e2e - the call, and ``network_ms`` = the call - this hop's e2e;
  otherwise both together as ``unattributed_ms`` = gateway e2e - hop e2e.
- ``gateway_ms`` = the sum of the gateways' ``processing_ms``; NULL when none is attributed.
- ``network_ms`` = outermost e2e - engine e2e - gateway_ms (0 when NULL); NULL without an
  engine hop and when the engine itself is the outermost hop (not observed, never 0).
- ``network_client_gateway_ms`` = client e2e - outermost gateway e2e (both present);
  ``network_gateway_engine_ms`` = innermost gateway e2e - engine e2e (both present).
- ``ttft_ms`` = the outermost hop's ttft; ``engine_ttft_ms`` = the engine's.
- ``tpot_ms`` = decode / (completion_tokens - 1) if completion_tokens > 1 and decode
  is known (vLLM's definition).
- ``request_id``, ``model``, ``engine_config``, ``replica_group``, ``prompt_tokens``,
  ``completion_tokens``: the engine's value, else the gateway's, else the client's.
- ``status``: 'error' if any hop ``is_error``, else 'ok'.
- ``cached_prompt_tokens``: the engine's, else the nearest gateway's, else the client's.
- ``served_from``: 'engine', unless the request has no engine hop and its innermost gateway says
  ``exact_cache`` | ``semantic_cache``: then that gateway (the *server*) stands in for the engine: queue, prefill
  and decode are 0, ``overhead_ms`` = server e2e - lookup (0 when NULL), ``network_ms`` = outermost e2e - server
  e2e - gateway_ms (NULL when the server is the outermost hop), ``lookup_ms`` = the server's and
  ``cached_prompt_tokens`` NULL (no engine read the prompt). ``lookup_ms`` is NULL on engine-served rows (a
  miss's lookup is inside the gateway's time), so for every row, NULLs as 0:
  ``e2e = network + gateway + lookup + overhead + queue + prefill + decode``.

Nothing is clamped: a slightly negative network or overhead (clock skew between hosts,
rounding of the engine's float seconds) is kept as is, because clamping would break
``e2e = network + gateway + overhead + queue + prefill + decode`` (gateway 0 when NULL),
which holds exactly (to floating point) whenever the other five are non-NULL.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from collectors.base import CACHE_CLASSES, LLMCall, Role

__all__ = ["Hop", "RequestRecord", "decompose_trace", "prompt_bucket"]

_CLIENT, _GATEWAY, _ENGINE = 0, 1, 2
_RANK: dict[object, int] = {Role.CLIENT: _CLIENT, Role.GATEWAY: _GATEWAY, Role.ENGINE: _ENGINE}
_MISSING = object()
_CACHE_CLASSES = frozenset(CACHE_CLASSES)  # LLMCall.served_from of a response-cache hit


@dataclasses.dataclass(slots=True)
class Hop:
    """One observed hop of a request (outermost first in `RequestRecord.hops`)."""

    role: str            # 'client' | 'gateway' | 'engine'
    span_id: str
    service: str
    convention: str
    name: str
    start_ns: int
    duration_ms: float   # span duration (end - start)
    ttft_ms: float | None
    # From the hop above to this one (None on the outermost hop): the network, when the hop above is a
    # client or a gateway showing its call to this hop; else the network and the upper gateway's own
    # processing together, unattributed.
    network_ms: float | None = None
    unattributed_ms: float | None = None
    processing_ms: float | None = None  # a gateway's own time: its span minus its call to the next hop
    trace_id: str | None = None  # set on the hops of a row joined across traces (traces/joins.py)


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """One LLM request of a trace with its latency decomposition (None = not observed)."""

    trace_id: str
    request_key: str                  # span id of the anchor call (engine, else gateway, else client)
    request_id: str | None
    start_ns: int
    service: str
    model: str | None
    engine_config: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    prompt_bucket: str
    e2e_ms: float
    ttft_ms: float | None
    engine_ttft_ms: float | None
    tpot_ms: float | None
    network_ms: float | None
    network_client_gateway_ms: float | None
    network_gateway_engine_ms: float | None
    overhead_ms: float | None
    queue_ms: float | None
    prefill_ms: float | None
    decode_ms: float | None
    hops: list[Hop]
    status: str                       # 'ok' | 'error'
    replica_group: str | None         # the group of the engine replica (else as the gateway or client saw it)
    gateway_ms: float | None = None   # Σ the gateways' own processing where attributed (see Hop), else None
    joined_by: str = ""               # 'response_id' when the hops came from several traces (traces/joins.py)
    linked_trace_ids: tuple[str, ...] = ()  # the other traces of a joined row
    cached_prompt_tokens: int | None = None  # prompt tokens read from a cache (engine, else gateway, else client)
    served_from: str = "engine"       # 'engine' | 'exact_cache' | 'semantic_cache' (the gateway's response cache)
    lookup_ms: float | None = None    # the gateway's response-cache lookup, when it reported one


def prompt_bucket(tokens: int | None) -> str:
    """Bucket of a prompt length: '<256', '<1k', '<4k', '<16k', '>=16k', or 'unknown'."""
    if tokens is None:
        return "unknown"
    if tokens < 256:
        return "<256"
    if tokens < 1024:
        return "<1k"
    if tokens < 4096:
        return "<4k"
    if tokens < 16384:
        return "<16k"
    return ">=16k"


def _rank_of(role: object) -> int | None:
    rank = _RANK.get(role)
    if rank is None and isinstance(role, str):
        try:
            rank = _RANK.get(Role(role.lower()))
        except ValueError:
            return None
    return rank


def _record(client: LLMCall | None, gateways: list[LLMCall], engine: LLMCall | None,
            parents: Mapping[str, str] | None = None,
            calls_under: Mapping[str, list[tuple[str, int, int]]] | None = None) -> RequestRecord:
    """One request from its hops: the client (or None), the gateways outermost first, the engine (or None)."""
    hops: list[Hop] = []
    client_e2e = engine_e2e = None
    # Hops are built inline (not through a helper): one request row per trace on the ingest path.
    if client is not None:
        client_e2e = (client.end_ns - client.start_ns) / 1e6
        hops.append(Hop("client", client.span_id, client.service, client.convention, client.name,
                        client.start_ns, client_e2e, client.ttft_ms))
    for gateway in gateways:
        hops.append(Hop("gateway", gateway.span_id, gateway.service, gateway.convention, gateway.name,
                        gateway.start_ns, (gateway.end_ns - gateway.start_ns) / 1e6, gateway.ttft_ms))
    queue = prefill = decode = overhead = engine_ttft = None
    if engine is not None:
        duration = (engine.end_ns - engine.start_ns) / 1e6
        engine_e2e = engine.engine_e2e_ms
        if engine_e2e is None:
            engine_e2e = duration
        hops.append(Hop("engine", engine.span_id, engine.service, engine.convention, engine.name,
                        engine.start_ns, duration, engine.ttft_ms))
        queue, prefill, decode = engine.queue_ms, engine.prefill_ms, engine.decode_ms
        if queue is not None and prefill is not None and decode is not None:
            overhead = engine_e2e - (queue + prefill + decode)
        engine_ttft = engine.ttft_ms
        anchor = engine
    elif gateways:
        anchor = gateways[-1]
    else:
        anchor = client

    chain = ([client] if client is not None else []) + gateways + ([engine] if engine is not None else [])
    # Per hop: what separates it from the hop above. A gateway that shows its call to the next hop as a
    # child span (the next hop's direct parent, e.g. LiteLLM's litellm_request or an HTTP client span)
    # splits into its own processing (its span minus that call) and the network (the call minus the next
    # hop); otherwise the two are one unattributed figure. Below a client it is all network.
    gateway_ms = None
    for index in range(1, len(hops)):
        upper, lower = hops[index - 1], hops[index]
        lower_e2e = engine_e2e if lower.role == "engine" else lower.duration_ms
        gap = upper.duration_ms - lower_e2e
        if upper.role == "client":
            lower.network_ms = gap
            continue
        call_ms = None
        candidates = calls_under.get(upper.span_id) if calls_under else None
        if candidates:
            # The gateway's call to this hop: the next hop's direct parent when it is one of the gateway's call
            # spans; otherwise (a forwarded traceparent, rule 5) the gateway's call span in flight when the next
            # hop started, the latest to start.
            parent = parents.get(lower.span_id)
            if parent is None:
                parent = chain[index].parent_span_id
            best = None
            for sid, start, end in candidates:
                if sid == parent:
                    best = (start, end, sid)
                    break
                if start <= lower.start_ns <= end and (best is None or (start, sid) > (best[0], best[2])):
                    best = (start, end, sid)
            if best is not None:
                call_ms = (best[1] - best[0]) / 1e6
        if call_ms is None:
            lower.unattributed_ms = gap
        else:
            upper.processing_ms = upper.duration_ms - call_ms
            lower.network_ms = call_ms - lower_e2e
            gateway_ms = upper.processing_ms if gateway_ms is None else gateway_ms + upper.processing_ms

    outer = client if client is not None else (gateways[0] if gateways else engine)
    e2e = client_e2e if client is not None else (hops[0].duration_ms if gateways else engine_e2e)
    network = None
    if engine is not None and outer is not engine:
        network = e2e - engine_e2e - (gateway_ms or 0.0)
    net_cg = client_e2e - hops[1].duration_ms if (client is not None and gateways) else None
    net_ge = hops[-2].duration_ms - engine_e2e if (gateways and engine is not None) else None

    e = engine or _NO_CALL
    c = client or _NO_CALL
    inner = gateways[::-1] if len(gateways) > 1 else gateways  # nearest the engine first, after the engine
    # The engine's value, else the nearest gateway's, else the client's; the engine usually has them all.
    prompt_tokens = e.prompt_tokens
    if prompt_tokens is None:
        prompt_tokens = _pick("prompt_tokens", inner, c)
    completion_tokens = e.completion_tokens
    if completion_tokens is None:
        completion_tokens = _pick("completion_tokens", inner, c)
    cached_prompt_tokens = e.cached_prompt_tokens
    if cached_prompt_tokens is None:
        cached_prompt_tokens = _pick("cached_prompt_tokens", inner, c)
    if cached_prompt_tokens is not None and prompt_tokens is not None and cached_prompt_tokens > prompt_tokens:
        cached_prompt_tokens = None  # from hops that disagree: dropped, as a normaliser drops its own
    request_id = e.request_id or _pick_text("request_id", inner, c)
    model = e.model or _pick_text("model", inner, c)
    engine_config = e.engine_config or _pick_text("engine_config", inner, c)
    replica_group = e.replica_group or _pick_text("replica_group", inner, c)
    tpot = None
    if decode is not None and completion_tokens is not None and completion_tokens > 1:
        tpot = decode / (completion_tokens - 1)
    served_from, lookup = "engine", None
    if engine is None and gateways and gateways[-1].served_from in _CACHE_CLASSES:
        # Answered from the innermost gateway's response cache (docs/decomposition.md): that gateway takes the
        # engine's place, its lookup and the rest of its own time split it; no engine read any prompt.
        server = gateways[-1]
        served_from, lookup, cached_prompt_tokens = server.served_from, server.lookup_ms, None
        queue = prefill = decode = 0.0
        server_e2e = hops[-1].duration_ms
        overhead = server_e2e - (lookup or 0.0)
        if outer is not server:
            network = e2e - server_e2e - (gateway_ms or 0.0)
    error = e.is_error or c.is_error
    if not error:
        for gateway in gateways:
            if gateway.is_error:
                error = True
                break
    # Positional (field order of RequestRecord): one is built per request on the ingest path,
    # and 23 keyword arguments cost about twice as much as positions.
    return RequestRecord(
        anchor.trace_id,  # trace_id
        anchor.span_id,  # request_key
        request_id,
        outer.start_ns,  # start_ns
        outer.service,  # service
        model,
        engine_config,
        prompt_tokens,
        completion_tokens,
        prompt_bucket(prompt_tokens),
        e2e,  # e2e_ms
        outer.ttft_ms,  # ttft_ms
        engine_ttft,  # engine_ttft_ms
        tpot,  # tpot_ms
        network,  # network_ms
        net_cg,  # network_client_gateway_ms
        net_ge,  # network_gateway_engine_ms
        overhead,  # overhead_ms
        queue,  # queue_ms
        prefill,  # prefill_ms
        decode,  # decode_ms
        hops,
        "error" if error else "ok",  # status
        replica_group,
        gateway_ms,
        "",  # joined_by
        (),  # linked_trace_ids
        cached_prompt_tokens,
        served_from,
        lookup,  # lookup_ms
    )


def _pick(field: str, gateways: list, client):
    """The nearest gateway's value, else the client's (None when neither has one)."""
    for gateway in gateways:
        value = getattr(gateway, field)
        if value is not None:
            return value
    return getattr(client, field)


def _pick_text(field: str, gateways: list, client):
    """As _pick, skipping empty strings too."""
    for gateway in gateways:
        value = getattr(gateway, field)
        if value is not None and value != "":
            return value
    value = getattr(client, field)
    return value if value is not None and value != "" else None


class _NoCall:
    """Stand-in for an absent hop: every optional figure is None."""

    __slots__ = ()
    prompt_tokens = completion_tokens = cached_prompt_tokens = request_id = model = engine_config = None
    replica_group = None
    is_error = False


_NO_CALL = _NoCall()


def _simple_chain(calls: list[LLMCall], parents: Mapping[str, str]):
    """`(client, gateway, engine)` (absent hops None) when the calls are at most one per role, each
    the direct child of the next higher role present (engine -> gateway -> client), and the topmost
    one has no LLM call above it: the shape of nearly every trace (an SDK call through a gateway to
    vLLM). Otherwise None, and the general rules below apply.

    For such a chain the general rules always give one request with every call as a hop (rule 1
    walks from the engine to its parent gateway, which has no rival; rule 2's client claim finds the
    gateway's parent client; with no engine, the gateway or lone client anchors it), so this answers
    the same as the general algorithm without its dictionaries, walks and memos (~3x cheaper).
    """
    slots: list = [None, None, None]
    for call in calls:
        rank = _RANK.get(call.role)
        if rank is None or slots[rank] is not None:
            return None  # a role given as text, or two calls of one role: the general rules
        slots[rank] = call
    client, gateway, engine = slots
    if len(calls) > 1 and len({call.span_id for call in calls}) != len(calls):
        return None  # one span reported under two roles: the general de-duplication decides
    below = None
    for call in (engine, gateway, client):
        if call is None:
            continue
        if below is not None:
            # The LLM parent of `below` must be this call, directly (the parent map wins over the
            # call's own parent_span_id, as in the general walk).
            parent = parents.get(below.span_id)
            if parent is None:
                parent = below.parent_span_id
            if parent != call.span_id:
                return None
        below = call
    if below is None:
        return None
    # The top call: no LLM parent when its parent is a root marker, or a span that is not an LLM call
    # of this trace and has no known parent itself (missing, or a root). Anything longer: general walk.
    parent = parents.get(below.span_id)
    if parent is None:
        parent = below.parent_span_id
    if parent and (parents.get(parent) or any(c is not None and c.span_id == parent for c in slots)):
        return None
    return slots


def _claim_key(call: LLMCall) -> tuple[int, str]:
    """Rule 3 order: the attempt that ends last wins; ties -> larger span id."""
    return (call.end_ns, call.span_id)


def _nearest_above(span: str | None, wanted: int, up: Mapping[str, str | None], rank: Mapping[str, int],
                   memo: dict[str, str | None]) -> tuple[str | None, list[str]]:
    """The nearest span of rank ``wanted`` from ``span`` up (None when an engine or the root comes first) and the
    spans passed on the way. A span whose answer ``memo`` holds ends the walk with it; the passed spans' answer
    goes into ``memo``."""
    path = []
    found = None
    s = span
    while s is not None:
        r = rank[s]
        if r == wanted:
            found = s
            break
        if r == _ENGINE:
            break
        m = memo.get(s, _MISSING)
        if m is not _MISSING:
            found = m
            break
        path.append(s)
        s = up[s]
    for x in path:
        memo[x] = found
    return found, path


def decompose_trace(calls: Iterable[LLMCall], parents: Mapping[str, str],
                    span_times: Mapping[str, tuple[int, int]] | None = None) -> list[RequestRecord]:
    """One `RequestRecord` per LLM request of one trace, sorted by (start_ns, request_key).

    ``calls``: every LLM call known so far for the trace, any order. ``parents``:
    span_id -> parent_span_id ('' for roots) of every span known in the trace,
    LLM or not. ``span_times``: span_id -> (start_ns, end_ns) of non-LLM spans, where known (a gateway's
    own call to the next hop, e.g. an HTTP client span, splits its processing from the network). See the
    module docstring for the rules.
    """
    if calls.__class__ is not list:
        calls = list(calls)
    if len(calls) <= 3:  # most traces: one SDK call, gateway and engine call; answered without the rules
        chain = _simple_chain(calls, parents)
        if chain is not None:
            client, gateway, engine = chain
            return [_record(client, [] if gateway is None else [gateway], engine)]

    # -- index the calls (deterministic de-duplication by span id) ---------------------
    by_id: dict[str, LLMCall] = {}
    rank: dict[str, int] = {}
    for call in calls:
        r = _RANK.get(call.role)
        if r is None:
            r = _rank_of(call.role)
            if r is None:
                continue
        sid = call.span_id
        if sid in by_id:
            prev = by_id[sid]
            if prev is call or (r, repr(call)) <= (rank[sid], repr(prev)):
                continue
        by_id[sid] = call
        rank[sid] = r
    if not by_id:
        return []

    # -- LLM parent of each call, through non-LLM spans (memoised, cycle-safe) ---------
    up: dict[str, str | None] = {}
    above: dict[str, str | None] = {}   # non-LLM span id -> nearest LLM call at/above it
    limit = len(parents) + 1
    for sid, call in by_id.items():
        p = parents.get(sid)
        if p is None:
            p = call.parent_span_id
        if not p:
            up[sid] = None
            continue
        if p in by_id:
            up[sid] = p
            continue
        found = above.get(p, _MISSING)
        if found is not _MISSING:
            up[sid] = found
            continue
        path = []
        s = p
        while True:
            if s in by_id:
                found = s
                break
            found = above.get(s, _MISSING)
            if found is not _MISSING:
                break
            path.append(s)
            s = parents.get(s)
            if not s or len(path) > limit:   # root, missing span, or a cycle
                found = None
                break
        for x in path:
            above[x] = found
        up[sid] = found

    # -- cut cycles among LLM calls at their smallest span id --------------------------
    seen: dict[str, int] = {}
    for walk, start in enumerate(up):
        if start in seen:
            continue
        path = []
        s = start
        while s is not None and s not in seen:
            seen[s] = walk
            path.append(s)
            s = up[s]
        if s is not None and seen[s] == walk:
            up[min(path[path.index(s):])] = None

    # -- rule 4: calls with a same-role LLM child are wrappers -------------------------
    # A gateway under a gateway of ANOTHER service is not wrapped by it: the upper one is the next
    # gateway of a chain (LiteLLM in front of the platform's gateway). Same service: one hop.
    wrappers = set()
    for sid, p in up.items():
        if p is not None and rank[p] == rank[sid]:
            if rank[sid] == _GATEWAY and by_id[p].service != by_id[sid].service:
                continue
            wrappers.add(p)

    # -- rule 5: a gateway that forwarded its caller's traceparent is a sibling ---------
    # LiteLLM (forward_traceparent_to_llm_provider) passes on the traceparent it RECEIVED, so the next hop's
    # span is a sibling of LiteLLM's span, not its child (measured with LiteLLM 1.108). A gateway of another
    # service with the same direct parent, in flight when the hop's span started, is the hop above it.
    by_parent: dict[str, list[str]] = {}
    for sid, r in rank.items():
        if r == _GATEWAY:
            p = parents.get(sid)
            if p is None:
                p = by_id[sid].parent_span_id
            if p:
                by_parent.setdefault(p, []).append(sid)
    sibling_memo: dict[str, str | None] = {}

    def sibling_gateway(sid: str) -> str | None:
        """The innermost gateway of another service sharing ``sid``'s direct parent, in flight when ``sid`` started."""
        if not by_parent:
            return None
        found = sibling_memo.get(sid, _MISSING)
        if found is not _MISSING:
            return found
        p = parents.get(sid)
        if p is None:
            p = by_id[sid].parent_span_id
        call = by_id[sid]
        best = None
        for x in by_parent.get(p, ()) if p else ():
            other = by_id[x]
            if x == sid or other.service == call.service or x in wrappers:
                continue
            # The upstream was in flight when the hop started. Not "contains it": the upstream may close its
            # span (on receiving the response) a moment before the hop closes its own (after sending it).
            if not other.start_ns <= call.start_ns <= other.end_ns:
                continue
            if other.start_ns == call.start_ns and x < sid:
                continue  # equal starts: only one of the two may be the other's upstream
            key = (other.start_ns, x)  # the latest to start is the innermost; ties to the larger span id
            if best is None or key > best[0]:
                best = (key, x)
        found = None if best is None else best[1]
        sibling_memo[sid] = found
        return found

    # -- rule 1 + 3: engines claim their nearest gateway -------------------------------
    engines = [sid for sid, r in rank.items() if r == _ENGINE]
    gateway_of: dict[str, str] = {}      # engine -> nearest gateway (candidate)
    passed: set[str] = set()             # clients passed over below a gateway hop (absorbed)
    gw_memo: dict[str, str | None] = {}  # client -> nearest gateway above it (engine walks)
    for e in engines:
        g, path = _nearest_above(up[e], _GATEWAY, up, rank, gw_memo)
        if path and g is not None:
            passed.update(path)
        if g is None:
            g = sibling_gateway(e)
        if g is not None:
            gateway_of[e] = g

    def next_gateway(hop: str) -> str | None:
        """The gateway a chain continues to above gateway ``hop``: the nearest gateway ancestor of another
        service, skipping that service's own wrappers and its own outgoing SDK call (a client span of the
        same service just below it); None when a client, an engine or the root comes first."""
        sibling = sibling_gateway(hop)
        if sibling is not None:
            return sibling
        below_service = by_id[hop].service
        s = up[hop]
        while s is not None:
            r = rank[s]
            if r == _ENGINE:
                return None
            if r == _GATEWAY:
                if by_id[s].service == below_service:  # a wrapper of the hop (same process): one hop
                    s = up[s]
                    continue
                return s
            # A client: the upstream gateway's own call to this hop when a gateway of its service is its
            # nearest LLM ancestor; otherwise the application, which ends the chain.
            a = up[s]
            while a is not None and rank[a] == _CLIENT:
                a = up[a]
            if a is not None and rank[a] == _GATEWAY and by_id[a].service == by_id[s].service:
                s = a
                continue
            return None
        return None

    def passed_between(low: str, high: str) -> list[str]:
        """The clients between ``low`` and its ancestor ``high`` (none when ``high`` is a sibling, rule 5)."""
        out = []
        s = up[low]
        while s is not None and s != high:
            if rank[s] == _CLIENT:
                out.append(s)
            s = up[s]
        return out if s == high else []

    # Requests grow upwards one gateway at a time, all at once per round; a gateway wanted by several
    # goes to the request whose current outermost hop ends last (rule 3), the others stop growing.
    claimed: set[str] = set()
    requests: list[list] = []   # [client, [gateways, innermost first], engine]
    stopped: list[tuple[list, bool]] = []  # (request, looks for a client)

    def grow(active: list[list]) -> None:
        while active:
            wanted: dict[str, list[list]] = {}
            for req in active:
                top = req[1][-1]
                nxt = next_gateway(top)
                if nxt is None or nxt in claimed:
                    stopped.append((req, nxt is None))
                    continue
                wanted.setdefault(nxt, []).append(req)
            active = []
            for nxt, reqs in wanted.items():
                win = max(reqs, key=lambda req: _claim_key(by_id[req[1][-1]]))
                for req in reqs:
                    passed.update(passed_between(req[1][-1], nxt))
                    if req is not win:
                        stopped.append((req, False))
                win[1].append(nxt)
                claimed.add(nxt)
                active.append(win)

    first: dict[str, list[list]] = {}
    for e in engines:
        g = gateway_of.get(e)
        req = [None, [], e]
        requests.append(req)
        if g is None:
            s = up[e]
            if s is not None and rank[s] == _CLIENT:
                stopped.append((req, True))
            continue
        first.setdefault(g, []).append(req)
    active = []
    for g, reqs in first.items():
        win = max(reqs, key=lambda req: _claim_key(by_id[req[2]]))
        win[1].append(g)
        claimed.add(g)
        active.append(win)
    grow(active)

    # -- rule 2: gateways no engine request took anchor their own (lowest first) --------
    remaining = {sid for sid, r in rank.items() if r == _GATEWAY and sid not in claimed and sid not in wrappers}
    while remaining:
        targets = {next_gateway(g) for g in remaining}
        anchors = sorted(g for g in remaining if g not in targets) or [min(remaining)]
        active = []
        for g in anchors:
            req = [None, [g], None]
            requests.append(req)
            claimed.add(g)
            active.append(req)
        grow(active)
        remaining -= claimed

    # -- rule 3 for clients: the nearest client above each request's outermost hop ------
    client_claims: dict[str, tuple[tuple[int, str], list]] = {}
    cl_memo: dict[str, str | None] = {}
    for req, looks in stopped:
        if not looks:
            continue
        top = req[1][-1] if req[1] else req[2]
        c, _ = _nearest_above(up[top], _CLIENT, up, rank, cl_memo)
        if c is not None:
            key = _claim_key(by_id[top])
            cur = client_claims.get(c)
            if cur is None or key > cur[0]:
                client_claims[c] = (key, req)

    for c, (_, req) in client_claims.items():
        req[0] = c
    for sid, r in rank.items():
        if r == _CLIENT and sid not in client_claims and sid not in wrappers and sid not in passed:
            requests.append([sid, [], None])

    # -- figures ----------------------------------------------------------------------
    get = by_id.get
    # Each call span under its nearest LLM ancestor, when that is a gateway: the gateway's calls to the next hop
    # (a store read may also list LLM client spans among its CLIENT-kind spans: they are calls, not call spans).
    calls_under: dict[str, list[tuple[str, int, int]]] = {}
    for sid, (start, end) in (span_times or {}).items():
        if sid in by_id:
            continue
        p = parents.get(sid)
        owner = None
        steps = 0
        while p and steps <= limit:
            if p in by_id:
                owner = p
                break
            found = above.get(p, _MISSING)
            if found is not _MISSING:
                owner = found
                break
            p = parents.get(p)
            steps += 1
        if owner is not None and rank[owner] == _GATEWAY:
            calls_under.setdefault(owner, []).append((sid, start, end))
    # An absorbed client call (a gateway's own instrumented call to the next hop) is a call span of the nearest
    # gateway above it.
    for sid in passed:
        g = up[sid]
        while g is not None and rank[g] != _GATEWAY:
            g = up[g]
        if g is not None:
            calls_under.setdefault(g, []).append((sid, by_id[sid].start_ns, by_id[sid].end_ns))
    records = [_record(None if c is None else get(c), [get(g) for g in reversed(gs)],
                       None if e is None else get(e), parents, calls_under)
               for c, gs, e in requests]
    if len(records) > 1:
        records.sort(key=lambda rec: (rec.start_ns, rec.request_key))
    return records
