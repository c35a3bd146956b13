"""Gates: the document's checks, and the verdicts of comparisons made of known samples."""
from __future__ import annotations

import numpy as np
import pytest
from regressions import gates

pytestmark = pytest.mark.mode_independent  # no database, no broker: CI runs it once (tests/conftest.py)


def results(values: dict[str, list[float]], *, success=None, passed=None, bucket="<256") -> list[dict]:
    n = len(next(iter(values.values())))
    return [{"item_id": f"i{i}", "repetition": 0, "success": True if success is None else success[i],
             "metrics": {m: v[i] for m, v in values.items()}, "prompt_bucket": bucket,
             "passed": None if passed is None else passed[i], "scores": {}, "has_evaluators": passed is not None}
            for i in range(n)]


def test_default_gates_are_complete():
    config = gates.parse_gates(None)
    assert config["confidence"] == 0.95 and config["power"] == 0.8
    assert [g["metric"] for g in config["gates"]] == ["ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "error_rate",
                                                      "pass_rate"]


@pytest.mark.parametrize("document, expected", [
    ({"gates": [{"metric": "ttft_p95"}]}, "gates[0].metric: unknown metric 'ttft_p95'"),
    ({"gates": [{"metric": "ttft_ms", "stat": "p97", "max_increase_pct": 10}]}, "gates[0].stat must be one of"),
    ({"gates": [{"metric": "ttft_ms"}]}, "gates[0] needs max_increase_pct and/or max_increase_ms"),
    ({"gates": [{"metric": "ttft_ms", "max_increase_pct": -1}]}, "gates[0].max_increase_pct must be a number"),
    ({"gates": [{"metric": "e2e_ms", "max_increase_pct": 5, "threshold": 3}]}, "gates[0]: unknown keys threshold"),
    ({"confidence": 2}, "confidence must be a number between 0.5 and 0.999"),
    ({"gates": []}, "gates must be a list of 1-50 gates"),
    ({"gate": []}, "unknown keys gate"),
    ([1, 2], "the gates document must be a mapping"),
])
def test_bad_gate_documents_are_refused_naming_the_problem(document, expected):
    with pytest.raises(gates.GateError) as caught:
        gates.parse_gates(document)
    assert any(expected in problem for problem in caught.value.problems), caught.value.problems


def test_identical_distributions_pass():
    rng = np.random.default_rng(1)
    base = rng.lognormal(5, 0.3, 200)
    noise = rng.normal(0, 3, 200)
    comparison = gates.compare(results({"ttft_ms": list(base)}), results({"ttft_ms": list(base + noise)}),
                               gates.parse_gates({"gates": [{"metric": "ttft_ms", "max_increase_pct": 10}]}),
                               paired=True)
    gate = comparison["gates"][0]
    assert comparison["verdict"] == "pass", gate
    assert gate["ci"][0] < 0 < gate["ci"][1] and gate["p_value"] > 0.05


def test_a_real_rise_fails_and_the_gate_says_everything_about_it():
    rng = np.random.default_rng(2)
    base = rng.lognormal(5, 0.3, 200)
    queue_base, queue_cand = np.zeros(200), rng.uniform(50, 150, 200)
    comparison = gates.compare(
        results({"ttft_ms": list(base), "queue_ms": list(queue_base)}),
        results({"ttft_ms": list(base + queue_cand), "queue_ms": list(queue_cand)}),
        gates.parse_gates({"gates": [{"metric": "ttft_ms", "stat": "p95", "max_increase_pct": 10}]}), paired=True)
    gate = comparison["gates"][0]
    assert comparison["verdict"] == "fail"
    assert gate["passed"] is False and gate["shift"] > 0.1 * gate["baseline"]
    assert gate["ci"][0] > 0 and gate["p_value"] < 1e-10
    assert gate["cause"] == "queue_ms" and "queue time" in gate["reason"]
    assert all(f"{value:.1f}" in gate["reason"] for value in (gate["baseline"], gate["candidate"]))


def test_a_tiny_sample_is_inconclusive_with_power_and_the_sample_needed():
    rng = np.random.default_rng(3)
    base = list(rng.lognormal(5, 0.5, 24))
    cand = [v * rng.normal(1.0, 0.3) for v in base]
    comparison = gates.compare(results({"e2e_ms": base}), results({"e2e_ms": cand}),
                               gates.parse_gates({"gates": [{"metric": "e2e_ms", "max_increase_pct": 5}]}),
                               paired=True)
    gate = comparison["gates"][0]
    assert comparison["verdict"] == "inconclusive"
    assert 0 < gate["power"] < 0.8 and gate["needed_items"] > 24
    assert "power" in gate["reason"] and str(gate["needed_items"]) in gate["reason"]
    few = gates.compare(results({"e2e_ms": base[:3]}), results({"e2e_ms": cand[:3]}),
                        gates.parse_gates({"gates": [{"metric": "e2e_ms", "max_increase_pct": 5}]}), paired=True)
    assert few["verdict"] == "inconclusive" and "a p95 needs at least 20" in few["gates"][0]["reason"]


def test_a_candidate_failing_half_its_requests_fails_with_its_error_rate():
    base = results({"e2e_ms": [100.0] * 10})
    cand = results({"e2e_ms": [100.0] * 10}, success=[i % 2 == 0 for i in range(10)])
    comparison = gates.compare(base, cand, gates.parse_gates(None), paired=True)
    error_gate = next(g for g in comparison["gates"] if g["metric"] == "error_rate")
    assert comparison["verdict"] == "fail" and error_gate["verdict"] == "fail"
    assert error_gate["candidate"] == 50.0 and "failed 50%" in error_gate["reason"]


def test_pass_rate_gate_uses_mcnemar_when_paired():
    base = results({"e2e_ms": [100.0] * 40}, passed=[True] * 40)
    dropped = results({"e2e_ms": [100.0] * 40}, passed=[i >= 15 for i in range(40)])
    comparison = gates.compare(base, dropped, gates.parse_gates({"gates": [{"metric": "pass_rate"}]}), paired=True)
    gate = comparison["gates"][0]
    assert gate["test"] == "mcnemar" and gate["discordant"] == [15, 0]
    assert gate["verdict"] == "fail" and gate["p_value"] == pytest.approx(2 / 2**15)
    slight = results({"e2e_ms": [100.0] * 40}, passed=[i >= 1 for i in range(40)])
    comparison = gates.compare(base, slight, gates.parse_gates({"gates": [{"metric": "pass_rate"}]}), paired=True)
    assert comparison["gates"][0]["verdict"] == "pass" and "not significant" in comparison["gates"][0]["reason"]


def test_unpaired_comparison_uses_mann_whitney_and_fisher():
    rng = np.random.default_rng(4)
    base = results({"ttft_ms": list(rng.normal(100, 5, 60))}, passed=[True] * 60)
    cand = results({"ttft_ms": list(rng.normal(100, 5, 60))}, passed=[True] * 60)
    comparison = gates.compare(base, cand, gates.parse_gates(None), paired=False)
    by_metric = {g["metric"]: g for g in comparison["gates"]}
    assert by_metric["ttft_ms"]["test"] == "mann-whitney" and by_metric["pass_rate"]["test"] == "fisher"
    assert by_metric["tpot_ms"]["verdict"] == "skipped"  # a default gate on a metric neither run has
    assert comparison["verdict"] == "pass"


def test_per_bucket_tables():
    rng = np.random.default_rng(5)
    short = results({"ttft_ms": list(rng.normal(50, 5, 30))}, bucket="<256")
    long = results({"ttft_ms": list(rng.normal(300, 20, 30))}, bucket="<4k")
    for i, r in enumerate(long):
        r["item_id"] = f"long{i}"
    long_cand = [dict(r, metrics={"ttft_ms": r["metrics"]["ttft_ms"] + 100}) for r in long]
    comparison = gates.compare(short + long, short + long_cand, gates.parse_gates(None), paired=True)
    assert set(comparison["buckets"]) == {"<256", "<4k"}
    long_row = comparison["buckets"]["<4k"][0]
    assert long_row["hl_shift"] == pytest.approx(100) and long_row["p_value"] < 1e-5
    assert comparison["buckets"]["<256"][0]["hl_shift"] == 0
