"""The SLO diagnosis names the gateways' own processing (gateway_ms, chains of gateways) as its own component."""
from __future__ import annotations

from alerts import diagnosis, queries


def _component(relevant: bool, base: float | None, burn: float | None) -> dict:
    return {"relevant": relevant, "burning": {"mean_ms": burn}, "baseline": {"mean_ms": base},
            "delta_mean_ms": None if base is None or burn is None else burn - base}


def test_gateway_is_a_component_of_every_latency_sli_but_tpot():
    assert "gateway_ms" in queries.COMPONENTS and diagnosis.COMPONENT_NAMES["gateway_ms"] == "gateway"
    assert "gateway_ms" in diagnosis.RELEVANT["ttft_ms"] and "gateway_ms" in diagnosis.RELEVANT["e2e_ms"]
    assert "gateway_ms" not in diagnosis.RELEVANT["tpot_ms"]


def test_a_rise_of_gateway_processing_is_the_dominant_component_with_its_own_next_step():
    components = {"network": _component(True, 20.0, 25.0), "gateway": _component(True, 5.0, 240.0),
                  "overhead": _component(True, 2.0, 2.5), "queue": _component(True, 0.0, 1.0),
                  "prefill": _component(True, 30.0, 31.0), "decode": _component(True, 400.0, 405.0)}
    name, why = diagnosis.dominant_component(components, have_baseline=True)
    assert name == "gateway" and "5.0 ms → 240.0 ms" in why
    step = diagnosis.suggest("gateway", burn={}, base=None, top={}, hops={}, engine={})
    assert step["component"] == "gateway" and "litellm_request" in step["text"]
