"""Caches in the decomposition (docs/decomposition.md, "Caches"): a row's cached prompt tokens come from the engine
hop, else the nearest gateway, else the client; a request the gateway answered from its response cache is a row
served_from exact_cache | semantic_cache whose e2e = network + gateway + lookup + overhead exactly."""
from __future__ import annotations

import time

import pytest
from ingest.rows import CALL_COLUMNS, call_row
from test_decomposition import call, engine, parents_of
from traces import ch_migrate, joins
from traces.decomposition import decompose_trace
from traces.request_builder import rebuild_traces
from traces.row_encoding import encode_rows


def assert_identity(rec):
    """e2e = network + gateway + lookup + overhead + queue + prefill + decode, NULL network/gateway/lookup as 0."""
    parts = (rec.network_ms, rec.gateway_ms, rec.lookup_ms, rec.overhead_ms, rec.queue_ms, rec.prefill_ms,
             rec.decode_ms)
    assert rec.e2e_ms == pytest.approx(sum(p or 0.0 for p in parts), abs=1e-6)


def hit_chain(served_from="semantic_cache", lookup_ms=8.0, client=True, front=False):
    """client 0-100 ms -> [LiteLLM 2-98 with its call 5-95] -> gateway 10-90 answering from its cache."""
    calls = []
    top = "root"
    if client:
        calls.append(call("c1", top, "client", 0, 100, ttft_ms=60.0, prompt_tokens=700, completion_tokens=30,
                          cached_prompt_tokens=600, service="app"))
        top = "c1"
    extra = {"root": ""}
    if front:
        calls.append(call("l1", top, "gateway", 2, 98, service="litellm-proxy", cached_prompt_tokens=500))
        extra["lreq"] = "l1"
        top = "lreq"
    calls.append(call("g1", top, "gateway", 10, 90, service="llm-gateway", served_from=served_from,
                      lookup_ms=lookup_ms, model="llama", prompt_tokens=700, completion_tokens=30, ttft_ms=12.0,
                      cached_prompt_tokens=650))
    times = {"lreq": (5 * 1_000_000, 95 * 1_000_000)} if front else None
    return calls, parents_of(calls, **extra), times


@pytest.mark.parametrize("served_from", ["exact_cache", "semantic_cache"])
def test_a_hit_is_network_lookup_and_the_gateway_s_own_time(served_from):
    calls, parents, _ = hit_chain(served_from)
    [rec] = decompose_trace(calls, parents)
    assert [h.role for h in rec.hops] == ["client", "gateway"]
    assert (rec.served_from, rec.lookup_ms, rec.request_key) == (served_from, 8.0, "g1")
    assert (rec.queue_ms, rec.prefill_ms, rec.decode_ms) == (0.0, 0.0, 0.0)
    assert rec.overhead_ms == pytest.approx(80.0 - 8.0)
    assert rec.network_ms == pytest.approx(100.0 - 80.0)
    assert rec.e2e_ms == pytest.approx(rec.network_ms + rec.lookup_ms + rec.overhead_ms)
    assert_identity(rec)
    assert (rec.ttft_ms, rec.engine_ttft_ms, rec.tpot_ms) == (60.0, None, None)  # the client's, as measured
    assert rec.cached_prompt_tokens is None  # no engine read the prompt
    assert (rec.prompt_tokens, rec.model, rec.status) == (700, "llama", "ok")
    assert rec.network_client_gateway_ms == pytest.approx(20.0)


def test_a_hit_behind_a_gateway_with_a_call_span_counts_its_processing():
    calls, parents, times = hit_chain(front=True)
    [rec] = decompose_trace(calls, parents, times)
    assert [h.service for h in rec.hops] == ["app", "litellm-proxy", "llm-gateway"]
    assert rec.gateway_ms == pytest.approx(96.0 - 90.0)  # LiteLLM's span minus its call
    assert rec.network_ms == pytest.approx(100.0 - 80.0 - 6.0)
    assert rec.e2e_ms == pytest.approx(rec.network_ms + rec.gateway_ms + rec.lookup_ms + rec.overhead_ms)
    assert_identity(rec)


def test_a_hit_at_the_outermost_hop_has_no_network_and_a_missing_lookup_counts_as_zero():
    calls, parents, _ = hit_chain("exact_cache", lookup_ms=None, client=False)
    [rec] = decompose_trace(calls, parents)
    assert (rec.served_from, rec.network_ms, rec.lookup_ms) == ("exact_cache", None, None)
    assert rec.overhead_ms == rec.e2e_ms == pytest.approx(80.0)
    assert rec.ttft_ms == 12.0
    assert_identity(rec)


def test_a_miss_is_served_by_the_engine_and_its_lookup_is_inside_the_gateway_s_time():
    c = call("c1", "root", "client", 0, 1000, cached_prompt_tokens=1)
    g = call("g1", "c1", "gateway", 10, 990, lookup_ms=0.4, cached_prompt_tokens=2)
    e = engine("e1", "g1", cached_prompt_tokens=448)
    [rec] = decompose_trace([c, g, e], parents_of([c, g, e], root=""))
    assert (rec.served_from, rec.lookup_ms, rec.cached_prompt_tokens) == ("engine", None, 448)
    assert (rec.queue_ms, rec.prefill_ms, rec.decode_ms) == (50.0, 100.0, 780.0)
    assert_identity(rec)


def test_a_gateway_claiming_a_hit_with_an_engine_below_is_engine_served():
    g = call("g1", "root", "gateway", 10, 990, served_from="exact_cache", lookup_ms=3.0)
    e = engine("e1", "g1")
    [rec] = decompose_trace([g, e], parents_of([g, e], root=""))
    assert (rec.served_from, rec.queue_ms, rec.lookup_ms) == ("engine", 50.0, None)


@pytest.mark.parametrize("hops, expected", [
    ({"client": 5, "gateway": 6, "engine": 7}, 7),
    ({"client": 5, "gateway": 6, "engine": None}, 6),
    ({"client": 5, "gateway": None, "engine": None}, 5),
    ({"client": None, "gateway": None, "engine": None}, None),
])
def test_cached_prompt_tokens_from_the_engine_else_the_gateway_else_the_client(hops, expected):
    c = call("c1", "root", "client", 0, 1000, cached_prompt_tokens=hops["client"])
    g = call("g1", "c1", "gateway", 10, 990, cached_prompt_tokens=hops["gateway"])
    e = engine("e1", "g1", cached_prompt_tokens=hops["engine"])
    calls = [c, g, e]
    [rec] = decompose_trace(calls, parents_of(calls, root=""))
    assert rec.cached_prompt_tokens == expected
    two_gateways = [c, call("g0", "c1", "gateway", 5, 995, service="edge", cached_prompt_tokens=9),
                    call("g1", "g0", "gateway", 10, 990, cached_prompt_tokens=hops["gateway"]), e]
    [rec] = decompose_trace(two_gateways, parents_of(two_gateways, root=""))
    assert rec.cached_prompt_tokens == (expected if hops["gateway"] or hops["engine"] else 9)  # the nearest gateway


def test_a_hit_is_never_an_upper_piece_of_a_join():
    """A stored answer may carry the id of the request that filled the cache: the hit must not look for that
    request's engine."""
    calls, parents, _ = hit_chain(client=False)
    hit = calls[0]
    hit.request_id = "chatcmpl-original-0001"
    [rec] = decompose_trace(calls, parents)
    [piece] = joins.pieces_of(rec.trace_id, [rec], {hit.span_id: hit})
    assert piece.outer_key is None and piece.inner_keys == {"chatcmpl-original-0001"}
    hit.served_from = None  # the same gateway-only row served by nobody: an upper piece as before
    [rec] = decompose_trace(calls, parents)
    [piece] = joins.pieces_of(rec.trace_id, [rec], {hit.span_id: hit})
    assert piece.outer_key == "chatcmpl-original-0001"


def test_a_hit_row_round_trips_through_the_store(make_store):
    """Calls written as ingest writes them and decomposed from ClickHouse (not the ingest memory) give a row with
    the cache columns."""
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    calls, _parents, _ = hit_chain()
    miss = [call("c9", "", "client", 0, 1000), call("g9", "c9", "gateway", 10, 990, lookup_ms=0.5),
            engine("e9", "g9", cached_prompt_tokens=256)]
    base = time.time_ns() - 3_600 * 10**9
    for c in miss:
        c.trace_id = "9" * 32
    calls = calls + miss
    for c in calls:
        c.start_ns += base
        c.end_ns += base
    blob = encode_rows([call_row(3, 7, c) for c in calls])
    store.insert_encoded("llm_calls", CALL_COLUMNS, blob, "JSONCompactEachRow")
    assert rebuild_traces(store, 3, sorted({c.trace_id for c in calls})) == 2
    rows = store.query(
        "SELECT request_key, served_from, lookup_ms, cached_prompt_tokens, queue_ms, prefill_ms, decode_ms "
        f"FROM {store.table('llm_requests')} FINAL WHERE project_id = {{project_id:UInt32}} ORDER BY request_key",
        project_id=3)
    assert [tuple(r) for r in rows] == [("e9", "engine", None, 256, 50.0, 100.0, 780.0),
                                        ("g1", "semantic_cache", 8.0, None, 0.0, 0.0, 0.0)]
