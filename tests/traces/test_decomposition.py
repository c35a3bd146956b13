"""Tests for traces.decomposition: chain joining and the latency decomposition of docs/decomposition.md (its
sections "The definition" and "Joining the hops of one request")."""
from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from traces.decomposition import Hop, RequestRecord, decompose_trace, prompt_bucket

from collectors.base import LLMCall, Role

TRACE = "0af7651916cd43dd8448eb211c80319c"
MS = 1_000_000


def call(span_id, parent, role, start_ms, end_ms, **kw) -> LLMCall:
    kw.setdefault("convention", {"engine": "vllm", "gateway": "litellm", "client": "genai"}[Role(role).value])
    kw.setdefault("service", f"{Role(role).value}-svc")
    kw.setdefault("name", f"{Role(role).value} span")
    return LLMCall(
        trace_id=TRACE, span_id=span_id, parent_span_id=parent, role=Role(role),
        start_ns=int(round(start_ms * MS)), end_ns=int(round(end_ms * MS)), **kw,
    )


def parents_of(calls, **extra) -> dict[str, str]:
    """parents map: the LLM spans plus extra non-LLM spans (span_id=parent_id)."""
    out = {c.span_id: c.parent_span_id for c in calls}
    out.update(extra)
    return out


def engine(span_id, parent, start_ms=20.0, end_ms=975.0, **kw):
    figures = dict(engine_e2e_ms=950.0, queue_ms=50.0, prefill_ms=100.0, decode_ms=780.0,
                   ttft_ms=250.0, prompt_tokens=512, completion_tokens=40,
                   request_id="cmpl-engine", model="llama-3-8b", engine_config="cfg-a")
    figures.update(kw)
    return call(span_id, parent, "engine", start_ms, end_ms, **figures)


def components(rec: RequestRecord):
    return (rec.network_ms, rec.overhead_ms, rec.queue_ms, rec.prefill_ms, rec.decode_ms)


def assert_sum(rec: RequestRecord):
    parts = components(rec)
    if all(p is not None for p in parts):
        assert abs(sum(parts) + (rec.gateway_ms or 0.0) - rec.e2e_ms) <= 1e-6


def roles(rec):
    return [h.role for h in rec.hops]


def span_ids(rec):
    return [h.span_id for h in rec.hops]


# ---------------------------------------------------------------------------------------
# exact figures
# ---------------------------------------------------------------------------------------

def full_chain():
    c = call("c1", "root", "client", 0, 1000, ttft_ms=300.0, model="gpt-x", request_id="cli-1",
             prompt_tokens=500, completion_tokens=41, service="app")
    g = call("g1", "http1", "gateway", 10, 990, ttft_ms=280.0, model="llama", request_id="gw-1",
             service="gateway")
    e = engine("e1", "http2", service="vllm")
    return [c, g, e], parents_of([c, g, e], root="", http1="c1", http2="g1")


def test_client_gateway_engine_chain():
    calls, parents = full_chain()
    [rec] = decompose_trace(calls, parents)
    assert rec.trace_id == TRACE
    assert rec.request_key == "e1"
    assert rec.request_id == "cmpl-engine"
    assert rec.model == "llama-3-8b"
    assert rec.engine_config == "cfg-a"
    assert rec.service == "app"
    assert rec.start_ns == 0
    assert (rec.prompt_tokens, rec.completion_tokens) == (512, 40)
    assert rec.prompt_bucket == "<1k"
    assert rec.e2e_ms == pytest.approx(1000.0)
    assert rec.network_ms == pytest.approx(50.0)                  # 1000 - 950
    assert rec.network_client_gateway_ms == pytest.approx(20.0)   # 1000 - 980
    assert rec.network_gateway_engine_ms == pytest.approx(30.0)   # 980 - 950
    assert rec.overhead_ms == pytest.approx(20.0)                 # 950 - (50 + 100 + 780)
    assert (rec.queue_ms, rec.prefill_ms, rec.decode_ms) == (50.0, 100.0, 780.0)
    assert rec.ttft_ms == 300.0
    assert rec.engine_ttft_ms == 250.0
    assert rec.tpot_ms == pytest.approx(780.0 / 39)
    assert rec.status == "ok"
    assert roles(rec) == ["client", "gateway", "engine"]
    assert rec.hops[0] == Hop("client", "c1", "app", "genai", "client span", 0, 1000.0, 300.0)
    assert rec.hops[1].duration_ms == pytest.approx(980.0)
    assert rec.hops[2].duration_ms == pytest.approx(955.0)   # span duration, not engine e2e
    assert rec.network_ms == pytest.approx(rec.network_client_gateway_ms + rec.network_gateway_engine_ms)
    assert_sum(rec)
    assert sum(components(rec)) == pytest.approx(rec.e2e_ms, abs=1e-6)


@pytest.mark.parametrize("engine_group, gateway_group, expected", [
    ("canary", "stable", "canary"),  # the replica says which group it is in: that wins
    (None, "stable", "stable"),      # an engine that does not say: the group the gateway routed to
    ("", "stable", "stable"),
    (None, None, None),
])
def test_replica_group_engine_first_then_gateway(engine_group, gateway_group, expected):
    c = call("c1", "", "client", 0, 1000)
    g = call("g1", "c1", "gateway", 10, 990, replica_group=gateway_group)
    e = engine("e1", "g1", replica_group=engine_group)
    for calls in ([c, g, e], [e, g, c]):  # the fast path for simple chains and the general rules agree
        [rec] = decompose_trace(calls, parents_of(calls))
        assert rec.replica_group == expected
    two_engines = [c, g, e, engine("e2", "g1", start_ms=5, end_ms=6, replica_group="other")]
    records = {r.request_key: r for r in decompose_trace(two_engines, parents_of(two_engines))}  # general rules
    assert records["e1"].replica_group == expected  # the retry ending last has the gateway and client hops
    assert records["e2"].replica_group == "other"


def test_engine_only():
    e = engine("e1", "")
    [rec] = decompose_trace([e], parents_of([e]))
    assert roles(rec) == ["engine"]
    assert rec.e2e_ms == 950.0                      # gen_ai.latency.e2e, not the span duration
    assert rec.network_ms is None                   # not observed, never 0
    assert rec.network_client_gateway_ms is None and rec.network_gateway_engine_ms is None
    assert rec.overhead_ms == pytest.approx(20.0)
    assert rec.ttft_ms == 250.0 and rec.engine_ttft_ms == 250.0
    assert rec.service == "engine-svc" and rec.start_ns == 20 * MS
    assert rec.request_key == "e1"


def test_engine_only_without_engine_e2e_uses_span_duration():
    e = engine("e1", "", start_ms=0, end_ms=940, engine_e2e_ms=None)
    [rec] = decompose_trace([e], {})
    assert rec.e2e_ms == pytest.approx(940.0)
    assert rec.overhead_ms == pytest.approx(10.0)   # 940 - 930
    assert rec.network_ms is None
    assert_sum(rec)


def test_gateway_engine():
    g = call("g1", "", "gateway", 0, 970, ttft_ms=270.0, request_id="gw-1", model="alias")
    e = engine("e1", "g1")
    [rec] = decompose_trace([g, e], parents_of([g, e]))
    assert roles(rec) == ["gateway", "engine"]
    assert rec.e2e_ms == pytest.approx(970.0)
    assert rec.network_ms == pytest.approx(20.0)
    assert rec.network_gateway_engine_ms == pytest.approx(20.0)
    assert rec.network_client_gateway_ms is None
    assert rec.ttft_ms == 270.0 and rec.engine_ttft_ms == 250.0
    assert rec.request_id == "cmpl-engine" and rec.model == "llama-3-8b"
    assert rec.service == "gateway-svc" and rec.start_ns == 0
    assert_sum(rec)


def test_client_engine_through_non_llm_spans():
    c = call("c1", "agent", "client", 5, 1005, ttft_ms=None)
    e = engine("e1", "httpx")
    parents = parents_of([c, e], agent="", fw="c1", retry="fw", httpx="retry")
    [rec] = decompose_trace([c, e], parents)
    assert roles(rec) == ["client", "engine"]
    assert rec.e2e_ms == pytest.approx(1000.0)
    assert rec.network_ms == pytest.approx(50.0)
    assert rec.network_client_gateway_ms is None and rec.network_gateway_engine_ms is None
    assert rec.ttft_ms is None                      # the outermost hop did not report it
    assert rec.engine_ttft_ms == 250.0
    assert_sum(rec)


def test_client_only():
    c = call("c1", "", "client", 0, 1200, ttft_ms=400.0, model="gpt-4o", request_id="chatcmpl-1",
             prompt_tokens=3000, completion_tokens=11)
    [rec] = decompose_trace([c], parents_of([c]))
    assert roles(rec) == ["client"]
    assert rec.request_key == "c1" and rec.request_id == "chatcmpl-1" and rec.model == "gpt-4o"
    assert rec.e2e_ms == pytest.approx(1200.0)
    assert rec.ttft_ms == 400.0
    assert rec.prompt_bucket == "<4k"
    assert components(rec) == (None, None, None, None, None)
    assert rec.engine_ttft_ms is None and rec.tpot_ms is None
    assert rec.network_client_gateway_ms is None and rec.network_gateway_engine_ms is None


def test_gateway_only_with_client():
    c = call("c1", "", "client", 0, 800)
    g = call("g1", "c1", "gateway", 30, 770, request_id="gw-1", model="gpt-4o")
    [rec] = decompose_trace([c, g], parents_of([c, g]))
    assert roles(rec) == ["client", "gateway"]
    assert rec.request_key == "g1" and rec.request_id == "gw-1"
    assert rec.e2e_ms == pytest.approx(800.0)
    assert rec.network_client_gateway_ms == pytest.approx(60.0)
    assert rec.network_ms is None and rec.network_gateway_engine_ms is None


def test_gateway_only():
    g = call("g1", "", "gateway", 0, 700, ttft_ms=90.0)
    [rec] = decompose_trace([g], parents_of([g]))
    assert roles(rec) == ["gateway"]
    assert rec.e2e_ms == pytest.approx(700.0) and rec.ttft_ms == 90.0
    assert components(rec) == (None, None, None, None, None)


def test_missing_components_are_none():
    e = engine("e1", "", queue_ms=None, ttft_ms=None, prompt_tokens=None, completion_tokens=None,
               request_id=None, model=None, engine_config=None)
    g = call("g1", "", "gateway", 0, 990, model="from-gw", prompt_tokens=77)
    e.parent_span_id = "g1"
    [rec] = decompose_trace([g, e], parents_of([g, e]))
    assert rec.queue_ms is None and rec.overhead_ms is None
    assert rec.prefill_ms == 100.0 and rec.decode_ms == 780.0
    assert rec.network_ms == pytest.approx(40.0)
    assert rec.engine_ttft_ms is None and rec.ttft_ms is None
    assert rec.model == "from-gw"                 # engine's, else gateway's
    assert rec.prompt_tokens == 77 and rec.prompt_bucket == "<256"
    assert rec.completion_tokens is None and rec.tpot_ms is None
    assert rec.request_id is None and rec.engine_config is None


@pytest.mark.parametrize("tokens, expected", [(None, None), (0, None), (1, None), (2, 780.0), (40, 20.0)])
def test_tpot(tokens, expected):
    e = engine("e1", "", completion_tokens=tokens)
    [rec] = decompose_trace([e], {})
    assert rec.tpot_ms == (None if expected is None else pytest.approx(expected))


def test_tpot_needs_decode():
    e = engine("e1", "", decode_ms=None, completion_tokens=10)
    [rec] = decompose_trace([e], {})
    assert rec.tpot_ms is None and rec.overhead_ms is None


def test_tpot_uses_client_tokens_when_engine_has_none():
    c = call("c1", "", "client", 0, 1000, completion_tokens=5)
    e = engine("e1", "c1", completion_tokens=None, decode_ms=100.0)
    [rec] = decompose_trace([c, e], parents_of([c, e]))
    assert rec.completion_tokens == 5 and rec.tpot_ms == pytest.approx(25.0)


@pytest.mark.parametrize("tokens, bucket", [
    (None, "unknown"), (0, "<256"), (255, "<256"), (256, "<1k"), (1023, "<1k"), (1024, "<4k"),
    (4095, "<4k"), (4096, "<16k"), (16383, "<16k"), (16384, ">=16k"), (200_000, ">=16k"),
])
def test_prompt_bucket(tokens, bucket):
    assert prompt_bucket(tokens) == bucket


@pytest.mark.parametrize("failing", ["c1", "g1", "e1"])
def test_error_status_propagates_from_any_hop(failing):
    calls, parents = full_chain()
    for c in calls:
        c.is_error = c.span_id == failing
    [rec] = decompose_trace(calls, parents)
    assert rec.status == "error"


def test_negative_components_are_not_clamped():
    # clock skew: the engine host's clock makes the engine look longer than the gateway
    g = call("g1", "", "gateway", 0, 940)
    e = engine("e1", "g1", engine_e2e_ms=950.0, queue_ms=60.0)
    [rec] = decompose_trace([g, e], parents_of([g, e]))
    assert rec.network_ms == pytest.approx(-10.0)
    assert rec.overhead_ms == pytest.approx(10.0)
    assert_sum(rec)


# ---------------------------------------------------------------------------------------
# chain rules
# ---------------------------------------------------------------------------------------

def test_agent_trace_yields_one_row_per_llm_call():
    calls, extra = [], {"agent": "", "tool": "agent"}
    for i, t0 in enumerate((0, 2000, 4000)):
        calls += [
            call(f"c{i}", "agent", "client", t0, t0 + 1000),
            call(f"g{i}", f"h{i}", "gateway", t0 + 10, t0 + 990),
            engine(f"e{i}", f"gh{i}", start_ms=t0 + 20, end_ms=t0 + 975),
        ]
        extra[f"h{i}"] = f"c{i}"
        extra[f"gh{i}"] = f"g{i}"
    calls.append(call("cx", "tool", "client", 6000, 6500, model="gpt-4o"))   # external provider
    recs = decompose_trace(calls, parents_of(calls, **extra))
    assert [r.request_key for r in recs] == ["e0", "e1", "e2", "cx"]
    assert [roles(r) for r in recs] == [["client", "gateway", "engine"]] * 3 + [["client"]]
    assert [r.start_ns for r in recs] == [0, 2000 * MS, 4000 * MS, 6000 * MS]
    for r in recs[:3]:
        assert r.e2e_ms == pytest.approx(1000.0) and r.network_ms == pytest.approx(50.0)
        assert_sum(r)


def test_retries_under_one_gateway_attach_to_the_engine_that_ends_last():
    c = call("c1", "", "client", 0, 2000)
    g = call("g1", "c1", "gateway", 10, 1990)
    e_fail = engine("ea", "g1", start_ms=20, end_ms=600, engine_e2e_ms=570.0, is_error=True)
    e_ok = engine("eb", "g1", start_ms=700, end_ms=1900, engine_e2e_ms=1150.0)
    recs = decompose_trace([e_ok, c, e_fail, g], parents_of([c, g, e_fail, e_ok]))
    by_key = {r.request_key: r for r in recs}
    assert [r.request_key for r in recs] == ["eb", "ea"]          # sorted by start_ns
    ok = by_key["eb"]
    assert span_ids(ok) == ["c1", "g1", "eb"] and ok.status == "ok"
    assert ok.network_ms == pytest.approx(2000.0 - 1150.0)
    assert ok.network_gateway_engine_ms == pytest.approx(1980.0 - 1150.0)
    failed = by_key["ea"]
    assert span_ids(failed) == ["ea"] and failed.status == "error"
    assert failed.network_ms is None and failed.e2e_ms == 570.0
    assert_sum(ok)
    assert_sum(failed)


def test_retry_tie_on_end_time_is_deterministic():
    g = call("g1", "", "gateway", 0, 1000)
    a = engine("ea", "g1", start_ms=10, end_ms=900)
    b = engine("eb", "g1", start_ms=20, end_ms=900)
    for order in ([g, a, b], [b, a, g]):
        recs = decompose_trace(order, parents_of([g, a, b]))
        assert {r.request_key: span_ids(r) for r in recs} == {"ea": ["ea"], "eb": ["g1", "eb"]}


def test_client_side_retry_through_two_gateway_calls():
    c = call("c1", "", "client", 0, 3000)
    g_a = call("ga", "c1", "gateway", 10, 1000, is_error=True)    # external provider, failed
    g_b = call("gb", "c1", "gateway", 1100, 2990)
    e = engine("e1", "gb", start_ms=1110, end_ms=2980)
    recs = decompose_trace([c, g_a, g_b, e], parents_of([c, g_a, g_b, e]))
    assert [(r.request_key, span_ids(r), r.status) for r in recs] == [
        ("e1", ["c1", "gb", "e1"], "ok"),     # starts at the client's start (0)
        ("ga", ["ga"], "error"),
    ]


def test_nested_client_wrappers_are_one_hop():
    lc = call("lc", "", "client", 0, 1100, convention="openinference", name="ChatOpenAI", ttft_ms=350.0)
    sdk = call("sdk", "lc", "client", 5, 1000, convention="openllmetry", name="openai.chat", ttft_ms=310.0)
    g = call("g1", "http", "gateway", 10, 990)
    e = engine("e1", "g1")
    recs = decompose_trace([lc, sdk, g, e], parents_of([lc, sdk, g, e], http="sdk"))
    assert len(recs) == 1
    assert span_ids(recs[0]) == ["sdk", "g1", "e1"]               # the nearest client is the hop
    assert recs[0].e2e_ms == pytest.approx(995.0) and recs[0].ttft_ms == 310.0
    assert_sum(recs[0])


def test_nested_client_wrapper_without_engine():
    lc = call("lc", "", "client", 0, 1100)
    sdk = call("sdk", "lc", "client", 5, 1000)
    [rec] = decompose_trace([lc, sdk], parents_of([lc, sdk]))
    assert span_ids(rec) == ["sdk"]


def test_wrapper_with_another_claim_stays_a_hop():
    # lc wraps sdk (-> e1) but is also the nearest client of an external gateway call g2
    lc = call("lc", "", "client", 0, 3000)
    sdk = call("sdk", "lc", "client", 5, 1000)
    e1 = engine("e1", "sdk")
    g2 = call("g2", "lc", "gateway", 1500, 2900)
    recs = decompose_trace([lc, sdk, e1, g2], parents_of([lc, sdk, e1, g2]))
    assert [span_ids(r) for r in recs] == [["lc", "g2"], ["sdk", "e1"]]


def test_nested_gateway_wrappers_are_one_hop():
    c = call("c1", "", "client", 0, 1000)
    router = call("router", "c1", "gateway", 5, 995, name="router")
    deploy = call("deploy", "router", "gateway", 10, 990, name="litellm_request")
    e = engine("e1", "deploy")
    [rec] = decompose_trace([c, router, deploy, e], parents_of([c, router, deploy, e]))
    assert span_ids(rec) == ["c1", "deploy", "e1"]
    assert rec.network_client_gateway_ms == pytest.approx(20.0)


def test_gateway_router_fallback_between_two_deployments():
    c = call("c1", "", "client", 0, 3000)
    router = call("router", "c1", "gateway", 5, 2995)
    d1 = call("d1", "router", "gateway", 10, 1000, is_error=True)
    e1 = engine("e1", "d1", start_ms=20, end_ms=990, is_error=True)
    d2 = call("d2", "router", "gateway", 1010, 2990)
    e2 = engine("e2", "d2", start_ms=1020, end_ms=2980)
    recs = decompose_trace([c, router, d1, e1, d2, e2], parents_of([c, router, d1, e1, d2, e2]))
    assert [span_ids(r) for r in recs] == [["c1", "d2", "e2"], ["d1", "e1"]]
    assert [r.status for r in recs] == ["ok", "error"]


def test_gateway_internal_client_span_is_absorbed():
    c = call("c1", "", "client", 0, 1000)
    g = call("g1", "c1", "gateway", 10, 990)
    inner = call("inner", "g1", "client", 12, 985, convention="openllmetry", service="gateway")
    e = engine("e1", "inner")
    [rec] = decompose_trace([c, g, inner, e], parents_of([c, g, inner, e]))
    assert span_ids(rec) == ["c1", "g1", "e1"]


def test_engine_under_engine_is_never_merged():
    outer = engine("eo", "", start_ms=0, end_ms=1000)
    inner = engine("ei", "eo", start_ms=10, end_ms=900)
    recs = decompose_trace([outer, inner], parents_of([outer, inner]))
    assert [span_ids(r) for r in recs] == [["eo"], ["ei"]]


def test_parent_cycles_terminate():
    # non-LLM cycle above the client, and an LLM cycle g <-> e
    c = call("c1", "x", "client", 0, 1000)
    g = call("g1", "e1", "gateway", 10, 990)
    e = engine("e1", "g1")
    parents = parents_of([c, g, e], x="y", y="x")
    recs = decompose_trace([c, g, e], parents)
    # the LLM cycle is cut at the smallest span id: 'e1' gets no LLM parent, and the
    # gateway's walk stops at the engine above it (a request never extends past an engine)
    assert sorted(span_ids(r) for r in recs) == [["c1"], ["e1"], ["g1"]]
    assert decompose_trace([e, g, c], dict(reversed(parents.items()))) == recs
    # self-parented spans
    s = call("s1", "s1", "client", 0, 10)
    assert [span_ids(r) for r in decompose_trace([s], {"s1": "s1"})] == [["s1"]]
    assert len(decompose_trace([s], {"s1": "z", "z": "z"})) == 1


def test_missing_intermediate_span_then_present():
    c = call("c1", "", "client", 0, 1000)
    g = call("g1", "http", "gateway", 10, 990)
    e = engine("e1", "g1")
    partial = parents_of([c, g, e])                     # 'http' (child of c1) not arrived yet
    recs = decompose_trace([c, g, e], partial)
    assert [span_ids(r) for r in recs] == [["c1"], ["g1", "e1"]]
    final = decompose_trace([c, g, e], {**partial, "http": "c1"})
    assert [span_ids(r) for r in final] == [["c1", "g1", "e1"]]
    assert final[0].network_client_gateway_ms == pytest.approx(20.0)


def test_llm_span_missing_from_parents_uses_its_own_parent_id():
    c = call("c1", "", "client", 0, 1000)
    e = engine("e1", "c1")
    [rec] = decompose_trace([c, e], {})
    assert span_ids(rec) == ["c1", "e1"]


def test_duplicate_span_records_are_resolved_deterministically():
    e = engine("e1", "")
    e2 = dataclasses.replace(e, queue_ms=55.0)
    a = decompose_trace([e, e2], {})
    b = decompose_trace([e2, e], {})
    assert a == b and len(a) == 1


def test_plain_string_roles_and_unknown_roles():
    e = engine("e1", "")
    e.role = "engine"
    odd = call("x", "", "client", 0, 1)
    odd.role = "tool"
    [rec] = decompose_trace([e, odd], {})
    assert roles(rec) == ["engine"]
    assert decompose_trace([], {}) == []


def test_large_agent_trace_is_not_quadratic():
    # 600 engine calls under one deep chain of nested client wrappers and one gateway
    calls = [call("root", "", "client", 0, 10_000)]
    parents = {"root": ""}
    prev = "root"
    for i in range(300):
        calls.append(call(f"w{i:04d}", prev, "client", i, 10_000 - i))
        prev = f"w{i:04d}"
    calls.append(call("gw", prev, "gateway", 400, 9000))
    for i in range(600):
        calls.append(call(f"in{i:04d}", "gw", "client", 500 + i, 600 + i))
        calls.append(engine(f"e{i:04d}", f"in{i:04d}", start_ms=500 + i, end_ms=590 + i))
    parents.update({c.span_id: c.parent_span_id for c in calls})
    recs = decompose_trace(calls, parents)
    assert len(recs) == 600
    winner = [r for r in recs if len(r.hops) == 3]
    assert [span_ids(r) for r in winner] == [["w0299", "gw", "e0599"]]


# ---------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------

_OPT_MS = st.one_of(st.none(), st.floats(min_value=0, max_value=5000, allow_nan=False, allow_infinity=False))
_OPT_TOK = st.one_of(st.none(), st.integers(min_value=0, max_value=40_000))


@st.composite
def traces(draw):
    """Random spans: LLM calls of random roles and non-LLM spans, random parent links.

    Parent links are mostly tree-like (to an earlier span), sometimes to any span
    (cycles, self-loops), to a span that never arrives, or to the root.
    """
    n = draw(st.integers(min_value=1, max_value=14))
    ids = [f"{i:016x}" for i in range(n)]
    draw(st.randoms(use_true_random=False)).shuffle(ids)   # ids unrelated to positions
    parents: dict[str, str] = {}
    calls: list[LLMCall] = []
    for i, sid in enumerate(ids):
        kind = draw(st.sampled_from(["tree", "tree", "tree", "any", "missing", "root"]))
        if kind == "tree" and i > 0:
            parent = ids[draw(st.integers(min_value=0, max_value=i - 1))]
        elif kind == "any":
            parent = ids[draw(st.integers(min_value=0, max_value=n - 1))]
        elif kind == "missing":
            parent = "ffffffffffffffff"
        else:
            parent = ""
        if draw(st.booleans()):                              # span known in the parents map?
            parents[sid] = parent
        if not draw(st.integers(min_value=0, max_value=2)):  # non-LLM span
            continue
        role = draw(st.sampled_from(list(Role)))
        start = draw(st.integers(min_value=0, max_value=10_000)) * 1000
        end = start + draw(st.integers(min_value=0, max_value=10_000_000)) * 1000
        kw = dict(ttft_ms=draw(_OPT_MS), prompt_tokens=draw(_OPT_TOK), completion_tokens=draw(_OPT_TOK),
                  is_error=draw(st.booleans()), model=draw(st.sampled_from([None, "", "m1", "m2"])),
                  request_id=draw(st.sampled_from([None, "r1", "r2"])))
        if role is Role.ENGINE:
            kw.update(engine_e2e_ms=draw(_OPT_MS), queue_ms=draw(_OPT_MS), prefill_ms=draw(_OPT_MS),
                      decode_ms=draw(_OPT_MS))
        # Gateways of two services: a gateway under another service's gateway is the next hop of a chain.
        service = draw(st.sampled_from(["svc-gateway", "svc-proxy"])) if role is Role.GATEWAY else f"svc-{role.value}"
        calls.append(LLMCall(TRACE, sid, parent, role, "genai", service, "span", start, end, **kw))
        if draw(st.integers(min_value=0, max_value=9)) == 0:   # the same span delivered twice
            calls.append(dataclasses.replace(calls[-1], ttft_ms=draw(_OPT_MS)))
    # Start and end of some non-LLM spans (a gateway's call to the next hop splits its processing off).
    llm = {c.span_id for c in calls}
    span_times = {sid: (t, t + draw(st.integers(min_value=0, max_value=10_000_000)) * 1000)
                  for sid in ids if sid not in llm and draw(st.booleans())
                  for t in [draw(st.integers(min_value=0, max_value=10_000)) * 1000]}
    return calls, parents, span_times


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_order_independence_and_invariants(trace, seed):
    calls, parents, span_times = trace
    expected = decompose_trace(calls, parents, span_times)

    rng = random.Random(seed)
    for _ in range(3):
        shuffled_calls = calls[:]
        rng.shuffle(shuffled_calls)
        items = list(parents.items())
        rng.shuffle(items)
        assert decompose_trace(shuffled_calls, dict(items), dict(reversed(list(span_times.items())))) == expected

    # sorted, every hop used at most once, every engine call anchors a request
    assert [(r.start_ns, r.request_key) for r in expected] == sorted((r.start_ns, r.request_key) for r in expected)
    hop_ids = [h.span_id for r in expected for h in r.hops]
    assert len(hop_ids) == len(set(hop_ids))
    engines = {c.span_id for c in calls if c.role is Role.ENGINE}
    assert engines <= set(hop_ids)
    assert len(expected) == len({r.request_key for r in expected})
    for r in expected:
        # hops ordered outermost first: client, gateways (a chain), engine; one client and one engine at most
        order = {"client": 0, "gateway": 1, "engine": 2}
        ranks = [order[h] for h in roles(r)]
        assert ranks == sorted(ranks) and ranks.count(0) <= 1 and ranks.count(2) <= 1
        assert r.start_ns == r.hops[0].start_ns and r.service == r.hops[0].service
        assert_sum(r)
        if r.hops[0].role == "engine":
            assert r.network_ms is None
        assert r.prompt_bucket == prompt_bucket(r.prompt_tokens)


# ---------------------------------------------------------------------------------------
# the simple-chain fast path answers exactly as the general rules
# ---------------------------------------------------------------------------------------

def test_simple_chain_fast_path_agrees_with_the_general_rules(monkeypatch):
    """Traces of at most three calls take a shortcut when they form one chain (engine -> gateway ->
    client); random small traces, many of them odd (shared ids, cycles, roles repeated, parents only in
    the map, non-LLM spans in between), must give the same records with and without it."""
    import traces.decomposition as decomposition

    rng = random.Random(20240601)
    ids = ["a", "b", "c", "x", "y", ""]
    shortcut = decomposition._simple_chain
    taken = 0
    for _ in range(20_000):
        calls = []
        for _ in range(rng.randint(0, 3)):
            start = rng.randint(0, 100)
            calls.append(call(rng.choice(ids[:4]), rng.choice(ids), rng.choice(["client", "gateway", "engine"]),
                              start, start + rng.randint(0, 50), ttft_ms=rng.choice([None, 1.5]),
                              engine_e2e_ms=rng.choice([None, 3.0]), queue_ms=rng.choice([None, 1.0]),
                              prefill_ms=rng.choice([None, 0.5]), decode_ms=rng.choice([None, 0.25]),
                              completion_tokens=rng.choice([None, 1, 7]), model=rng.choice([None, "", "m"]),
                              is_error=rng.random() < 0.2))
        parents = {rng.choice(ids[:5]): rng.choice(ids) for _ in range(rng.randint(0, 4))}
        if rng.random() < 0.5:
            for c in calls:
                parents.setdefault(c.span_id, c.parent_span_id)
        taken += shortcut(calls, parents) is not None
        fast = decompose_trace(calls, parents)
        monkeypatch.setattr(decomposition, "_simple_chain", lambda calls, parents: None)
        general = decompose_trace(calls, parents)
        monkeypatch.setattr(decomposition, "_simple_chain", shortcut)
        assert fast == general, (calls, parents)
    assert taken > 2_000  # the shortcut was exercised, not only the general rules
