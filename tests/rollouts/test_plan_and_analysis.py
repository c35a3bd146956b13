"""The rollout plan's checks and the canary analysis's verdicts on known samples (no platform)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from rollouts import analysis as A
from rollouts.plan import LATENCY_METRICS, PlanError, canary_gateway_weights, parse_plan

pytestmark = pytest.mark.mode_independent  # no database, no broker: CI runs it once (tests/conftest.py)


def problems_of(data, **kwargs) -> list[str]:
    with pytest.raises(PlanError) as caught:
        parse_plan(data, **kwargs)
    return caught.value.problems


def test_default_plan_gates_on_the_newest_dataset_then_three_canary_steps_then_promotes():
    plan = parse_plan(None, default_dataset="golden")
    assert [s["kind"] for s in plan["steps"]] == ["gate", "canary", "canary", "canary", "promote"]
    assert [s["weight"] for s in plan["steps"] if s["kind"] == "canary"] == [5, 25, 50]
    assert plan["steps"][0]["dataset"] == "golden" and plan["canary_replicas"] == 1
    # Without a dataset, no gate.
    assert [s["kind"] for s in parse_plan(None)["steps"]] == ["canary", "canary", "canary", "promote"]


def test_short_forms_and_durations():
    plan = parse_plan({"steps": [{"canary": 10, "interval": "2m"}, "approval", {"canary": {"weight": 40,
                                                                                          "interval_seconds": 90}}]})
    assert plan["steps"] == [{"kind": "canary", "weight": 10.0, "interval_seconds": 120.0}, {"kind": "approval"},
                             {"kind": "canary", "weight": 40.0, "interval_seconds": 90.0}, {"kind": "promote"}]


def test_every_problem_of_a_plan_is_reported_at_once():
    problems = problems_of({"steps": [{"canary": 30, "baseline": 60, "interval": 120}, {"canary": 20, "interval": 20},
                                      "promote", {"gate": {"dataset": "x"}}, {"kind": "jump"}],
                            "analysis": {"mde": 0.05, "alpha": 2, "bogus": 1}, "extra": True})
    text = "\n".join(problems)
    for expected in ("weights do not add up", "too short for the analysis", "must increase", "promote must be the last",
                     "the regression gate comes first", "gate, canary, approval or promote", "alpha",
                     "unknown key 'bogus'", "unknown key 'extra'", "above the minimum detectable effect"):
        assert expected in text, (expected, problems)


@pytest.mark.parametrize("weight", [0, 100, -5, "ten", True, math.inf])
def test_canary_weight_must_be_strictly_between_0_and_100(weight):
    assert any("weight" in p for p in problems_of({"steps": [{"canary": weight}]}))


def test_gateway_weights_give_the_canary_its_share_of_the_group_only():
    weights = canary_gateway_weights({"base": 90, "other": 10}, "base", "base-canary-1", 25)
    assert weights == {"base": 67.5, "other": 10.0, "base-canary-1": 22.5}


def test_the_baseline_twin_takes_as_much_as_the_canary_from_the_group():
    weights = canary_gateway_weights({"base": 90, "other": 10, "base-canary-1": 0, "base-baseline-1": 0}, "base",
                                     "base-canary-1", 25, twin="base-baseline-1")
    assert weights == {"base": 45.0, "other": 10.0, "base-canary-1": 22.5, "base-baseline-1": 22.5}
    assert canary_gateway_weights({"base": 1}, "base", "c", 50, twin="t") == {"base": 0.0, "c": 0.5, "t": 0.5}


def test_compared_with_a_twin_by_default_the_canary_takes_at_most_half():
    assert parse_plan(None)["compare_with"] == "twin"
    assert parse_plan({"compare_with": "group", "steps": [{"canary": 80}]})["compare_with"] == "group"
    assert any("at most 50%" in p and "compare_with: group" in p for p in problems_of({"steps": [{"canary": 60}]}))
    assert any("compare_with: twin or group" in p for p in problems_of({"compare_with": "prod"}))


def _sample(n: int, scale: float, rng, errors: int = 0, queue_share: float = 0.3) -> A.Sample:
    values = rng.gamma(4.0, scale / 4.0, n)
    sample = A.Sample(total=n + errors, errors=errors)
    sample.values = {m: values * (queue_share if m == "queue_ms" else 1.0) for m in LATENCY_METRICS}
    return sample


def _judge(baseline: A.Sample, canary: A.Sample, **analysis) -> dict:
    config = parse_plan({"analysis": analysis} if analysis else None)["analysis"]
    return A.analyse({"b": baseline, "c": canary}, baseline_group="b", canary_group="c", config=config)


def test_a_clear_regression_fails_with_values_and_its_explanation():
    rng = np.random.default_rng(3)
    baseline, canary = _sample(800, 180.0, rng), _sample(60, 180.0, rng)
    # Queue time is what grew, and TTFT with it; the rest is unchanged.
    canary.values = {m: v.copy() for m, v in canary.values.items()}
    canary.values["queue_ms"] += 120.0
    canary.values["ttft_ms"] += 120.0
    result = _judge(baseline, canary)
    assert result["verdict"] == "fail"
    ttft = next(m for m in result["metrics"] if m["metric"] == "ttft_ms")
    assert ttft["verdict"] == "fail" and ttft["ci"][0] > ttft["tolerance_ms"]
    assert ttft["explained_by"]["component"] == "queue_ms"
    assert result["reason"].startswith("TTFT p95 +") and "HL shift" in result["reason"] \
        and "queue time explains" in result["reason"] and "p < 0.001" in result["reason"]


def test_the_same_distribution_passes_with_enough_requests_and_is_inconclusive_with_few():
    rng = np.random.default_rng(4)
    baseline = _sample(1500, 180.0, rng)
    assert _judge(baseline, _sample(600, 180.0, rng))["verdict"] == "pass"
    few = _judge(baseline, _sample(30, 180.0, rng))
    assert few["verdict"] == "inconclusive" and "not enough data" in few["reason"]
    ttft = next(m for m in few["metrics"] if m["metric"] == "ttft_ms")
    assert ttft["needed"] and ttft["needed"] > 30


def test_no_data_is_never_a_pass_nor_a_fail():
    rng = np.random.default_rng(5)
    result = _judge(_sample(1000, 180.0, rng), _sample(0, 180.0, rng))
    assert result["verdict"] == "inconclusive"
    assert all(m["verdict"] == "inconclusive" for m in result["metrics"])
    # Even a huge shift on fewer requests than min_requests gives no verdict (sparse data misfires).
    assert _judge(_sample(1000, 180.0, rng), _sample(10, 5000.0, rng))["verdict"] == "inconclusive"


def test_an_improvement_passes_and_a_decrease_fails_only_where_lower_is_worse():
    rng = np.random.default_rng(6)
    baseline, better = _sample(1000, 200.0, rng), _sample(400, 120.0, rng)
    assert _judge(baseline, better)["verdict"] == "pass"
    metrics = [{"metric": "ttft_ms", "direction": "decrease", "tolerance": 0.1}]
    lower_is_worse = _judge(baseline, better, metrics=metrics, error_rate=False, slo=False)
    assert lower_is_worse["verdict"] == "fail"


def test_an_expected_change_is_judged_beyond_the_expectation_and_only_beyond_it():
    """A config that batches more sequences makes each token slower by design: TPOT 30% higher fails against the
    baseline alone, passes when that rise is expected, and a rise well beyond the expectation still fails."""
    rng = np.random.default_rng(9)
    baseline = _sample(1500, 40.0, rng)
    slower = _sample(800, 40.0, rng)
    slower.values = {m: v * 1.3 for m, v in slower.values.items()}
    plain = [{"metric": "tpot_ms"}]
    assert _judge(baseline, slower, metrics=plain, error_rate=False, slo=False)["verdict"] == "fail"
    expected = [{"metric": "tpot_ms", "expected": 0.3}]
    result = _judge(baseline, slower, metrics=expected, error_rate=False, slo=False)
    tpot = result["metrics"][0]
    assert result["verdict"] == "pass", result["reason"]
    assert tpot["expected_ms"] == pytest.approx(0.3 * tpot["baseline_median"])
    assert _judge(baseline, slower, metrics=[{"metric": "tpot_ms", "expected": 0.05}], error_rate=False,
                  slo=False)["verdict"] == "fail"
    much_slower = _sample(800, 40.0, rng)
    much_slower.values = {m: v * 1.8 for m, v in much_slower.values.items()}
    failed = _judge(baseline, much_slower, metrics=expected, error_rate=False, slo=False)
    assert failed["verdict"] == "fail" and "beyond the expected +" in failed["reason"], failed["reason"]
    # Few requests: the reason says what cannot be ruled out beyond the expectation.
    few = _judge(baseline, _sample(25, 52.0, rng), metrics=expected, error_rate=False, slo=False)
    assert few["verdict"] == "inconclusive" and "beyond the expected +" in few["reason"], few["reason"]


def test_an_expected_change_is_a_bounded_number():
    plan = parse_plan({"analysis": {"metrics": [{"metric": "tpot_ms", "expected": 0.25}]}})
    assert plan["analysis"]["metrics"][0]["expected"] == 0.25
    assert parse_plan(plan) == plan  # a parsed plan parses to itself (a loop passes one on)
    assert "expected" not in parse_plan(None)["analysis"]["metrics"][0]
    for bad in (-1, 11, "20%", True, math.nan):
        problems = problems_of({"analysis": {"metrics": [{"metric": "tpot_ms", "expected": bad}]}})
        assert any("analysis.metrics[0].expected: a number in [-0.9, 10]" in p for p in problems), problems


def test_error_rate_fails_on_fisher_beyond_tolerance():
    rng = np.random.default_rng(7)
    baseline, canary = _sample(1000, 180.0, rng, errors=5), _sample(200, 180.0, rng, errors=30)
    result = _judge(baseline, canary)
    assert result["errors"]["verdict"] == "fail" and result["errors"]["p"] < 0.001
    assert "error rate" in result["reason"]


def test_slo_scoped_to_the_group_fails_when_the_canary_burns_it():
    rng = np.random.default_rng(8)
    baseline, canary = _sample(1000, 100.0, rng), _sample(200, 100.0, rng)
    canary.values["ttft_ms"] = canary.values["ttft_ms"].copy()
    canary.values["ttft_ms"][:40] = 900.0  # 20% over the threshold against ~0%
    slos = [{"name": "ttft-fast", "sli": "ttft_ms", "threshold_ms": 500.0, "objective": 0.99}]
    config = parse_plan({"analysis": {"metrics": [], "error_rate": False}})["analysis"]
    result = A.analyse({"b": baseline, "c": canary}, baseline_group="b", canary_group="c", config=config, slos=slos)
    assert result["verdict"] == "fail" and result["slos"][0]["burn_canary"] == pytest.approx(20.0)
    assert "SLO ttft-fast burns" in result["reason"]


def test_hodges_lehmann_interval_covers_a_known_shift():
    rng = np.random.default_rng(9)
    x = rng.normal(100, 10, 400)
    y = rng.normal(130, 10, 300)
    shift, low, high = A.hl_interval(x, y, 0.99)
    assert low < 30 < high and abs(shift - 30) < 3
    # Too few values for the confidence asked: an unbounded interval, never a verdict.
    assert A.hl_interval(np.array([1.0, 2.0]), np.array([3.0]), 0.999)[1] == -math.inf


def test_metrics_that_need_not_pass_may_still_fail_the_step_but_never_hold_it_back():
    rng = np.random.default_rng(10)
    baseline, canary = _sample(1500, 180.0, rng), _sample(150, 180.0, rng)
    # Decode time spread a hundredfold by output lengths: a shift cannot be ruled out on these requests.
    for sample in (baseline, canary):
        sample.values = {m: v.copy() for m, v in sample.values.items()}
        sample.values["decode_ms"] = rng.lognormal(6.0, 2.0, sample.values["decode_ms"].size)
    result = _judge(baseline, canary)
    decode = next(m for m in result["metrics"] if m["metric"] == "decode_ms")
    assert decode["verdict"] == "inconclusive" and not decode["must_pass"]
    assert result["verdict"] == "pass"
    # Required, it holds the step back.
    metrics = [{"metric": m, "must_pass": True} for m in ("ttft_ms", "decode_ms")]
    assert _judge(baseline, canary, metrics=metrics)["verdict"] == "inconclusive"
    # A clear decode regression fails the step although decode need not pass.
    canary.values["decode_ms"] = canary.values["decode_ms"] * 3.0
    assert _judge(baseline, canary)["verdict"] == "fail"
    assert any("must_pass" in p for p in problems_of({"analysis": {"metrics": [{"metric": "ttft_ms",
                                                                                  "must_pass": "yes"}]}}))
