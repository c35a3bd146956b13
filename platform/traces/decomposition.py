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
   nearest GATEWAY call on that walk is its gateway hop; the nearest CLIENT call above
   the gateway hop (or above the engine if the walk met no gateway) is its client hop.
   CLIENT calls passed over between the engine and its gateway (e.g. the gateway
   process's own instrumented SDK call to the engine) are *absorbed* into the request.
2. A GATEWAY call that is not a hop of any engine request and is not absorbed (rule 4)
   anchors its own request (gateway -> external provider), with the nearest CLIENT
   above it as client hop. A CLIENT call that is not a hop of anything and is not
   absorbed anchors its own single-hop request.
3. Contention. When several requests want the same hop - a gateway that is the
   nearest gateway of several engine calls (retries, fallbacks, n>1 fan-out), or a
   client that is the nearest client of several requests (client-side retries) - the
   hop goes to the request whose current outermost hop ENDS LAST (the attempt whose
   answer came back), ties broken by the larger span id. The losers stop growing:
   an engine that loses its gateway becomes an engine-only request (the engine is its
   outermost hop, its network_ms is NULL) and does not look for a client; a request
   that loses its client keeps its gateway as outermost hop.
4. Nested calls of one role (two client instrumentations wrapping the same call,
   LangChain span around an OpenAI SDK span, LiteLLM router span around its
   deployment-call span) are one hop: the nearest one to the engine is the hop (rules
   1-2 always pick the nearest), and a call whose LLM parent has the same role makes
   that parent a *wrapper*. A wrapper that is not itself a hop of some request (its
   only possible "other claim") is absorbed. Engine calls are never merged: each is a
   separate unit of work of the engine and always anchors a request (rule 1).
   Absorbed calls belong to no row and do not affect any figure or the status.

Every LLM call therefore ends up as exactly one of: a hop of exactly one request, or
absorbed. Known limitation: a CLIENT call that is a leaf directly under a GATEWAY with
no engine below (a gateway's own instrumented SDK call to an external provider) is
indistinguishable from an application behind the gateway and anchors its own
client-only row next to the gateway's row.

Figures (DESIGN.md, "Latency decomposition")
--------------------------------------------
The outermost hop is the client if present, else the gateway, else the engine. A hop's
e2e is its span duration, except the engine hop, whose e2e is ``engine_e2e_ms`` (vLLM
``gen_ai.latency.e2e``) when present, else its span duration.

- ``e2e_ms`` = outermost e2e; ``start_ns`` / ``service`` = the outermost hop's.
- ``queue_ms`` / ``prefill_ms`` / ``decode_ms`` from the engine call.
- ``overhead_ms`` = engine e2e - (queue + prefill + decode); NULL if any is NULL.
- ``network_ms`` = outermost e2e - engine e2e; NULL without an engine hop and when
  the engine itself is the outermost hop (not observed, never 0).
- ``network_client_gateway_ms`` = client e2e - gateway e2e (both hops present);
  ``network_gateway_engine_ms`` = gateway e2e - engine e2e (both hops present).
- ``ttft_ms`` = the outermost hop's ttft; ``engine_ttft_ms`` = the engine's.
- ``tpot_ms`` = decode / (completion_tokens - 1) if completion_tokens > 1 and decode
  is known (vLLM's definition).
- ``request_id``, ``model``, ``engine_config``, ``replica_group``, ``prompt_tokens``,
  ``completion_tokens``: the engine's value, else the gateway's, else the client's.
- ``status``: 'error' if any hop ``is_error``, else 'ok'.

Nothing is clamped: a slightly negative network or overhead (clock skew between hosts,
rounding of the engine's float seconds) is kept as is, because clamping would break
``e2e = network + overhead + queue + prefill + decode``, which holds exactly (to
floating point) whenever all five are non-NULL.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from collectors.base import LLMCall, Role

__all__ = ["Hop", "RequestRecord", "decompose_trace", "prompt_bucket"]

_CLIENT, _GATEWAY, _ENGINE = 0, 1, 2
_RANK: dict[object, int] = {Role.CLIENT: _CLIENT, Role.GATEWAY: _GATEWAY, Role.ENGINE: _ENGINE}
_MISSING = object()


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


def _first(a, b, c):
    """First value that is neither None nor ''."""
    if a is not None and a != "":
        return a
    if b is not None and b != "":
        return b
    if c is not None and c != "":
        return c
    return None


def _record(client: LLMCall | None, gateway: LLMCall | None, engine: LLMCall | None) -> RequestRecord:
    hops: list[Hop] = []
    client_e2e = gateway_e2e = engine_e2e = None
    # Hops are built inline (not through a helper): one request row per trace on the ingest path.
    if client is not None:
        client_e2e = (client.end_ns - client.start_ns) / 1e6
        hops.append(Hop("client", client.span_id, client.service, client.convention, client.name,
                        client.start_ns, client_e2e, client.ttft_ms))
    if gateway is not None:
        gateway_e2e = (gateway.end_ns - gateway.start_ns) / 1e6
        hops.append(Hop("gateway", gateway.span_id, gateway.service, gateway.convention, gateway.name,
                        gateway.start_ns, gateway_e2e, gateway.ttft_ms))
    queue = prefill = decode = overhead = engine_ttft = None
    if engine is not None:
        duration = (engine.end_ns - engine.start_ns) / 1e6
        hops.append(Hop("engine", engine.span_id, engine.service, engine.convention, engine.name,
                        engine.start_ns, duration, engine.ttft_ms))
        engine_e2e = engine.engine_e2e_ms
        if engine_e2e is None:
            engine_e2e = duration
        queue, prefill, decode = engine.queue_ms, engine.prefill_ms, engine.decode_ms
        if queue is not None and prefill is not None and decode is not None:
            overhead = engine_e2e - (queue + prefill + decode)
        engine_ttft = engine.ttft_ms
        anchor = engine
    elif gateway is not None:
        anchor = gateway
    else:
        anchor = client
    outer = client if client is not None else (gateway if gateway is not None else engine)
    e2e = client_e2e if client is not None else (gateway_e2e if gateway is not None else engine_e2e)
    network = None if (engine is None or outer is engine) else e2e - engine_e2e
    net_cg = client_e2e - gateway_e2e if (client is not None and gateway is not None) else None
    net_ge = gateway_e2e - engine_e2e if (gateway is not None and engine is not None) else None

    e = engine or _NO_CALL
    g = gateway or _NO_CALL
    c = client or _NO_CALL
    prompt_tokens = e.prompt_tokens
    if prompt_tokens is None:
        prompt_tokens = g.prompt_tokens if g.prompt_tokens is not None else c.prompt_tokens
    completion_tokens = e.completion_tokens
    if completion_tokens is None:
        completion_tokens = g.completion_tokens if g.completion_tokens is not None else c.completion_tokens
    tpot = None
    if decode is not None and completion_tokens is not None and completion_tokens > 1:
        tpot = decode / (completion_tokens - 1)
    error = e.is_error or g.is_error or c.is_error
    # Positional (field order of RequestRecord): one is built per request on the ingest path,
    # and 23 keyword arguments cost about twice as much as positions.
    return RequestRecord(
        anchor.trace_id,  # trace_id
        anchor.span_id,  # request_key
        _first(e.request_id, g.request_id, c.request_id),  # request_id
        outer.start_ns,  # start_ns
        outer.service,  # service
        _first(e.model, g.model, c.model),  # model
        _first(e.engine_config, g.engine_config, c.engine_config),  # engine_config
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
        _first(e.replica_group, g.replica_group, c.replica_group),  # replica_group
    )


class _NoCall:
    """Stand-in for an absent hop: every optional figure is None."""

    __slots__ = ()
    prompt_tokens = completion_tokens = request_id = model = engine_config = replica_group = None
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


def decompose_trace(calls: Iterable[LLMCall], parents: Mapping[str, str]) -> list[RequestRecord]:
    """One `RequestRecord` per LLM request of one trace, sorted by (start_ns, request_key).

    ``calls``: every LLM call known so far for the trace, any order. ``parents``:
    span_id -> parent_span_id ('' for roots) of every span known in the trace,
    LLM or not. See the module docstring for the rules.
    """
    if calls.__class__ is not list:
        calls = list(calls)
    if len(calls) <= 3:  # most traces: one SDK call, gateway and engine call; answered without the rules
        chain = _simple_chain(calls, parents)
        if chain is not None:
            return [_record(*chain)]

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
    wrappers = set()
    for sid, p in up.items():
        if p is not None and rank[p] == rank[sid]:
            wrappers.add(p)

    # -- rule 1 + 3: engines claim their nearest gateway -------------------------------
    engines = [sid for sid, r in rank.items() if r == _ENGINE]
    gateway_of: dict[str, str] = {}      # engine -> nearest gateway (candidate)
    winner: dict[str, str] = {}          # gateway -> engine that got it
    passed: set[str] = set()             # clients passed over below a gateway hop (absorbed)
    gw_memo: dict[str, str | None] = {}  # client -> nearest gateway above it (engine walks)
    for e in engines:
        g = None
        path = []
        s = up[e]
        while s is not None:
            r = rank[s]
            if r == _GATEWAY:
                g = s
                break
            if r == _ENGINE:
                break
            m = gw_memo.get(s, _MISSING)
            if m is not _MISSING:
                g = m
                break
            path.append(s)
            s = up[s]
        if path:
            for x in path:
                gw_memo[x] = g
            if g is not None:
                passed.update(path)
        if g is not None:
            gateway_of[e] = g
            cur = winner.get(g)
            if cur is None or _claim_key(by_id[e]) > _claim_key(by_id[cur]):
                winner[g] = e

    # -- requests: [client, gateway, engine]; rule 3 for clients -----------------------
    requests: list[list] = []
    client_claims: dict[str, tuple[tuple[int, str], list]] = {}
    cl_memo: dict[str, str | None] = {}  # gateway -> nearest client above it

    def claim_client(req: list, top: str, s: str | None) -> None:
        path = []
        c = None
        while s is not None:
            r = rank[s]
            if r == _CLIENT:
                c = s
                break
            if r == _ENGINE:
                break
            m = cl_memo.get(s, _MISSING)
            if m is not _MISSING:
                c = m
                break
            path.append(s)
            s = up[s]
        for x in path:
            cl_memo[x] = c
        if c is not None:
            key = _claim_key(by_id[top])
            cur = client_claims.get(c)
            if cur is None or key > cur[0]:
                client_claims[c] = (key, req)

    for e in engines:
        g = gateway_of.get(e)
        if g is None:
            req = [None, None, e]
            s = up[e]
            if s is not None and rank[s] == _CLIENT:
                claim_client(req, e, s)
        elif winner[g] == e:
            req = [None, g, e]
            claim_client(req, g, up[g])
        else:
            req = [None, None, e]
        requests.append(req)

    for sid, r in rank.items():
        if r == _GATEWAY and sid not in winner and sid not in wrappers:
            req = [None, sid, None]
            claim_client(req, sid, up[sid])
            requests.append(req)

    for c, (_, req) in client_claims.items():
        req[0] = c
    for sid, r in rank.items():
        if r == _CLIENT and sid not in client_claims and sid not in wrappers and sid not in passed:
            requests.append([sid, None, None])

    # -- figures ----------------------------------------------------------------------
    get = by_id.get
    records = [_record(None if c is None else get(c), None if g is None else get(g),
                       None if e is None else get(e))
               for c, g, e in requests]
    if len(records) > 1:
        records.sort(key=lambda rec: (rec.start_ns, rec.request_key))
    return records
