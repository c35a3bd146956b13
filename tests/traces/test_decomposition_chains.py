"""Chains of gateways (LiteLLM → vLLM router → the platform's gateway → engine): one row per engine call with
every hop in order, the per-hop split of network and gateway processing, the same in every arrival order."""
from __future__ import annotations

import itertools
import random

import pytest
from test_decomposition import call, engine, parents_of, span_ids
from traces.decomposition import decompose_trace

MS = 1_000_000


def chain_of(hops: int):
    """Client → gateways of distinct services → engine, ``hops`` in all (2-5), nested 10 ms inside each other."""
    names = ["kong", "litellm", "router"][: max(0, hops - 3)]
    calls = [call("c1", "", "client", 0, 1200, service="app")]
    parent = "c1"
    start, end = 10, 1190
    for index, service in enumerate(names + ["gw"][: max(0, hops - 2)]):
        sid = f"g{index}"
        calls.append(call(sid, parent, "gateway", start, end, service=service))
        parent, start, end = sid, start + 10, end - 10
    calls.append(engine("e1", parent, start_ms=start, end_ms=end, engine_e2e_ms=end - start - 5.0))
    return calls


def exact_sum(rec) -> float:
    return rec.network_ms + (rec.gateway_ms or 0.0) + rec.overhead_ms + rec.queue_ms + rec.prefill_ms + rec.decode_ms


@pytest.mark.parametrize("hops", [2, 3, 4, 5])
def test_chain_of_any_length_is_one_row_in_every_arrival_order(hops):
    calls = chain_of(hops)
    if hops == 2:
        calls = [c for c in calls if c.role.value != "gateway"]
    parents = parents_of(calls)
    expected = decompose_trace(calls, parents)
    assert len(expected) == 1
    [rec] = expected
    assert [h.role for h in rec.hops] == ["client"] + ["gateway"] * (hops - 2) + ["engine"]
    assert rec.e2e_ms == pytest.approx(exact_sum(rec), abs=1e-6)
    assert rec.gateway_ms is None  # no gateway showed its upstream call: processing is not attributed
    for hop in rec.hops[2:]:
        assert hop.unattributed_ms is not None and hop.network_ms is None
    assert rec.hops[1].network_ms is not None  # client → first hop: network
    # Every arrival order (as the ingest sees it: calls and parent links in any order) gives the same row.
    orders = list(itertools.permutations(calls)) if len(calls) <= 5 else []
    for order in orders:
        items = list(parents.items())
        random.Random(len(order)).shuffle(items)
        assert decompose_trace(list(order), dict(items)) == expected


def test_litellm_in_front_of_the_gateway_with_its_upstream_call_span():
    """LiteLLM shows its call to the next hop as a child span: its processing and the network split exactly."""
    c = call("c1", "", "client", 0, 1000, service="app", ttft_ms=300.0)
    litellm = call("lit", "c1", "gateway", 5, 995, service="litellm-proxy", convention="litellm")
    gw = call("gw", "req", "gateway", 60, 980, service="llm-gateway", convention="genai")
    e = engine("e1", "gw", start_ms=70, end_ms=970, engine_e2e_ms=895.0)
    # litellm_request (LiteLLM's SDK call, not an LLM call of ours) is gw's parent: the upstream call.
    span_times = {"req": (50 * MS, 985 * MS)}
    parents = parents_of([c, litellm, gw, e], req="lit")
    [rec] = decompose_trace([c, litellm, gw, e], parents, span_times)
    assert span_ids(rec) == ["c1", "lit", "gw", "e1"]
    client_hop, lit_hop, gw_hop, engine_hop = rec.hops
    assert lit_hop.network_ms == pytest.approx(10.0)            # client 1000 − LiteLLM 990
    assert lit_hop.processing_ms == pytest.approx(990 - 935)    # LiteLLM 990 − its call 935
    assert gw_hop.network_ms == pytest.approx(935 - 920)        # its call 935 − gateway 920
    assert gw_hop.unattributed_ms is None
    assert engine_hop.unattributed_ms == pytest.approx(920 - 895)  # our gateway shows no child: unattributed
    assert rec.gateway_ms == pytest.approx(55.0)
    assert rec.network_ms == pytest.approx(1000 - 895 - 55)
    assert rec.e2e_ms == pytest.approx(exact_sum(rec), abs=1e-9)
    assert rec.network_client_gateway_ms == pytest.approx(10.0)  # client → outermost gateway
    assert rec.network_gateway_engine_ms == pytest.approx(25.0)  # innermost gateway → engine
    assert rec.ttft_ms == 300.0
    # Without the span's times, the same chain with the split unattributed; the sum still exact.
    [plain] = decompose_trace([c, litellm, gw, e], parents)
    assert plain.gateway_ms is None and plain.hops[2].unattributed_ms == pytest.approx(990 - 920)
    assert plain.network_ms == pytest.approx(1000 - 895) and plain.e2e_ms == pytest.approx(exact_sum(plain))


def test_upstream_gateways_own_client_span_is_absorbed_and_is_its_call():
    """OpenLLMetry inside LiteLLM records LiteLLM's call to the gateway as a client span of LiteLLM's service."""
    c = call("c1", "", "client", 0, 1000, service="app")
    litellm = call("lit", "c1", "gateway", 5, 995, service="litellm-proxy")
    sdk = call("sdk", "lit", "client", 40, 990, service="litellm-proxy", convention="openllmetry")
    gw = call("gw", "sdk", "gateway", 60, 980, service="llm-gateway")
    e = engine("e1", "gw", start_ms=70, end_ms=970, engine_e2e_ms=895.0)
    calls = [c, litellm, sdk, gw, e]
    [rec] = decompose_trace(calls, parents_of(calls))
    assert span_ids(rec) == ["c1", "lit", "gw", "e1"]
    # The absorbed client span is LiteLLM's call to the gateway: its processing and the network split.
    assert rec.hops[1].processing_ms == pytest.approx(990 - 950)
    assert rec.hops[2].network_ms == pytest.approx(950 - 920)
    assert rec.gateway_ms == pytest.approx(40.0) and rec.e2e_ms == pytest.approx(exact_sum(rec))


def test_retry_through_the_chain_goes_to_the_attempt_that_ends_last():
    c = call("c1", "", "client", 0, 3000, service="app")
    litellm = call("lit", "c1", "gateway", 5, 2995, service="litellm-proxy")
    g1 = call("g1", "lit", "gateway", 10, 1000, service="llm-gateway", is_error=True)
    e1 = engine("e1", "g1", start_ms=20, end_ms=990, is_error=True)
    g2 = call("g2", "lit", "gateway", 1010, 2990, service="llm-gateway")
    e2 = engine("e2", "g2", start_ms=1020, end_ms=2980)
    calls = [c, litellm, g1, e1, g2, e2]
    recs = decompose_trace(calls, parents_of(calls))
    assert [span_ids(r) for r in recs] == [["c1", "lit", "g2", "e2"], ["g1", "e1"]]
    assert [r.status for r in recs] == ["ok", "error"]


def test_chain_without_engine_is_one_row_anchored_at_the_innermost_gateway():
    """An aborted request: no engine span; LiteLLM → gateway still one row with both gateways."""
    c = call("c1", "", "client", 0, 500, service="app")
    litellm = call("lit", "c1", "gateway", 5, 495, service="litellm-proxy")
    gw = call("gw", "lit", "gateway", 20, 480, service="llm-gateway", is_error=True)
    calls = [c, litellm, gw]
    for order in itertools.permutations(calls):
        [rec] = decompose_trace(list(order), parents_of(calls))
        assert span_ids(rec) == ["c1", "lit", "gw"] and rec.request_key == "gw" and rec.status == "error"
        assert rec.network_ms is None and rec.queue_ms is None


def test_same_service_gateways_stay_one_hop():
    c = call("c1", "", "client", 0, 1000, service="app")
    router = call("router", "c1", "gateway", 5, 995, service="litellm-proxy")
    deploy = call("deploy", "router", "gateway", 10, 990, service="litellm-proxy")
    gw = call("gw", "deploy", "gateway", 20, 980, service="llm-gateway")
    e = engine("e1", "gw", start_ms=30, end_ms=970)
    calls = [c, router, deploy, gw, e]
    [rec] = decompose_trace(calls, parents_of(calls))
    assert span_ids(rec) == ["c1", "deploy", "gw", "e1"]


# What a real LiteLLM 1.108 proxy with forward_traceparent_to_llm_provider: true emitted, in front of the platform's
# gateway (spans read back from the platform, 2026-11-26): LiteLLM forwards the traceparent it RECEIVED, so the
# gateway's span is a sibling of LiteLLM's proxy span under the caller's span, not its child.
def litellm_sibling_trace(with_client: bool):
    parent = "c1" if with_client else "remote"
    calls = []
    if with_client:
        calls.append(call("c1", "", "client", 0, 540, service="app", convention="openllmetry"))
    calls += [
        call("proxy", parent, "gateway", 17.4, 513.6, service="litellm-proxy", name="Received Proxy Server Request"),
        call("gw", parent, "gateway", 396.6, 511.5, service="llm-gateway", name="chat llama"),
        engine("e1", "gw", start_ms=397.3, end_ms=510.4, engine_e2e_ms=112.0),
    ]
    extra = {"http": parent, "lreq": "proxy", "raw": "lreq", "router": "proxy"}  # LiteLLM's own non-LLM spans
    return calls, parents_of(calls, **extra)


@pytest.mark.parametrize("with_client", [True, False])
def test_litellm_forwarding_its_callers_traceparent_is_still_one_chain(with_client):
    calls, parents = litellm_sibling_trace(with_client)
    for order in itertools.permutations(calls):
        recs = decompose_trace(list(order), parents)
        assert [span_ids(r) for r in recs] == [(["c1"] if with_client else []) + ["proxy", "gw", "e1"]]
    [rec] = recs
    assert rec.model == "llama-3-8b" and rec.e2e_ms == pytest.approx(540 if with_client else 496.2)
    assert rec.hops[-2].unattributed_ms == pytest.approx(496.2 - 114.9)  # LiteLLM's processing + network
    assert rec.e2e_ms == pytest.approx(exact_sum(rec))


def test_litellm_straight_to_vllm_with_forwarded_traceparent():
    proxy = call("proxy", "remote", "gateway", 0, 500, service="litellm-proxy")
    e = engine("e1", "remote", start_ms=100, end_ms=480)
    [rec] = decompose_trace([proxy, e], parents_of([proxy, e]))
    assert span_ids(rec) == ["proxy", "e1"] and rec.network_ms is not None


def test_sibling_gateway_ending_a_moment_before_the_hop_is_still_its_upstream():
    """LiteLLM closes its span on receiving the response, a moment before the gateway closes its own."""
    proxy = call("proxy", "remote", "gateway", 0, 500, service="litellm-proxy")
    gw = call("gw", "remote", "gateway", 100, 500.3, service="llm-gateway")
    e = engine("e1", "gw", start_ms=110, end_ms=490)
    [rec] = decompose_trace([proxy, gw, e], parents_of([proxy, gw, e]))
    assert span_ids(rec) == ["proxy", "gw", "e1"]
    assert rec.e2e_ms == pytest.approx(exact_sum(rec))


def test_sibling_gateway_must_be_in_flight_when_the_hop_starts():
    """A sibling gateway that ended before the hop started is another request, never its upstream."""
    before = call("proxy", "remote", "gateway", 0, 100, service="litellm-proxy")
    gw = call("gw", "remote", "gateway", 150, 600, service="llm-gateway")
    e = engine("e1", "gw", start_ms=160, end_ms=590)
    recs = decompose_trace([before, gw, e], parents_of([before, gw, e]))
    assert [span_ids(r) for r in recs] == [["proxy"], ["gw", "e1"]]


def test_litellm_processing_is_split_from_the_network_by_its_litellm_request_span():
    """With the forwarded traceparent the gateway is not under litellm_request: the call span in flight when
    the gateway started is LiteLLM's call (as read back from a real LiteLLM 1.108)."""
    calls, parents = litellm_sibling_trace(with_client=True)
    span_times = {"lreq": (58.0 * MS, 314.1 * MS), "raw": (58.0 * MS, 314.1 * MS), "http": (1 * MS, 539 * MS)}
    parents = {**parents, "lreq": "proxy", "raw": "lreq"}
    # litellm_request ended before the gateway started: not in flight, so no split.
    [rec] = decompose_trace(calls, parents, span_times)
    assert rec.gateway_ms is None
    # In flight: LiteLLM 496.2 = processing 496.2 - 256.1 + its call 256.1; the call 256.1 = network + gateway 114.9.
    span_times = {"lreq": (390.0 * MS, 646.1 * MS), "raw": (390.0 * MS, 646.1 * MS)}
    for order in itertools.permutations(calls):
        [rec] = decompose_trace(list(order), parents, span_times)
        assert span_ids(rec) == ["c1", "proxy", "gw", "e1"]
        assert rec.hops[1].processing_ms == pytest.approx(496.2 - 256.1)
        assert rec.hops[2].network_ms == pytest.approx(256.1 - 114.9) and rec.hops[2].unattributed_ms is None
        assert rec.gateway_ms == pytest.approx(496.2 - 256.1)
        assert rec.e2e_ms == pytest.approx(exact_sum(rec))
