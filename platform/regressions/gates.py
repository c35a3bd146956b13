"""Gates and the comparison of a candidate with its baseline: per-metric tests, per-bucket tables, the verdict.

Gates file (YAML or JSON; every key optional; without a file the default gates are: p95 TTFT, TPOT and e2e, and
mean queue time, may rise by at most 10% (and at least 10 ms, 1 ms, 10 ms and 10 ms: smaller changes are below
what users notice and within the step-to-step noise of a replica; queue time's p95 under light load is mostly
where an arrival fell within an engine step, its mean tracks queueing), the error rate by 1 point, and the pass
rate not at all):

    confidence: 0.95      # of every interval and one-sided bound
    power: 0.8            # below this power against a gate's tolerance, a gate that did not fail is inconclusive
    gates:
      - metric: ttft_ms   # a latency metric: ttft_ms tpot_ms itl_ms e2e_ms engine_ttft_ms and the components
        stat: p95         # p50 p90 p95 p99 mean
        max_increase_pct: 10    # tolerance relative to the baseline's value ...
        max_increase_ms: 0      # ... or absolute; the larger of the two applies
      - metric: pass_rate       # items whose evaluators all pass; `evaluator: NAME` for one evaluator's
        max_decrease: 0         # percentage points
      - metric: error_rate
        max_increase: 1         # percentage points (and a candidate failing half its requests fails, always)
      - metric: consistency     # outputs equal to the baseline's (paired runs)
        min: 100                # percent

A latency gate compares the statistic of both samples: shift = candidate − baseline, with a bootstrap interval
(items resampled jointly when paired) and the rank test's p-value (Wilcoxon when paired, else Mann–Whitney).
  - fail: the rise is real (the interval's lower bound at `confidence`, one-sided, is above 0) and larger than
    the tolerance (the estimate exceeds it);
  - pass: not fail, the interval's upper bound is within the tolerance (confidently no larger rise), and the
    sample had `power` against a rise of the tolerance;
  - inconclusive: neither — the sample cannot tell; the gate reports its power against a rise of the tolerance
    and the number of items that would give `power`. Below 1/(1 − q) values per arm a q-quantile (20 for p95)
    is not estimated at all.
Quality gates: fail when the drop (rise, for errors) beyond the tolerance is significant (McNemar when paired,
Fisher's exact test otherwise), inconclusive below MIN_ITEMS compared items, else pass (a drop that is not
significant is reported with its p-value).
The run's verdict: fail if any gate fails, else inconclusive if any is, else pass.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from . import stats

LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "engine_ttft_ms", "network_ms", "gateway_ms",
                   "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
COMPONENTS = ("network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")
QUALITY_METRICS = ("pass_rate", "error_rate", "consistency")
STATS = ("p50", "p90", "p95", "p99", "mean")
DEFAULT_GATES = {
    "confidence": 0.95,
    "power": 0.8,
    "gates": [
        {"metric": "ttft_ms", "stat": "p95", "max_increase_pct": 10, "max_increase_ms": 10},
        {"metric": "tpot_ms", "stat": "p95", "max_increase_pct": 10, "max_increase_ms": 1},
        {"metric": "e2e_ms", "stat": "p95", "max_increase_pct": 10, "max_increase_ms": 10},
        {"metric": "queue_ms", "stat": "mean", "max_increase_pct": 10, "max_increase_ms": 10},
        {"metric": "error_rate", "max_increase": 1},
        {"metric": "pass_rate", "max_decrease": 0},
    ],
}
MIN_ITEMS = 5  # below this many values per arm a gate is inconclusive without further ado


def min_items(stat: str) -> int:
    """Values per arm below which a statistic is not estimated at all: a pXX needs 1/(1 − XX/100) values (20 for
    p95, 100 for p99) to hold one value above it; a mean or median MIN_ITEMS."""
    if stat.startswith("p") and stat != "p50":
        return max(MIN_ITEMS, round(1.0 / (1.0 - float(stat[1:]) / 100.0)))
    return MIN_ITEMS


class GateError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def _number(value: Any, where: str, problems: list[str], *, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        problems.append(f"{where} must be a number between {low:g} and {high:g}")
        return None
    return float(value)


def parse_gates(data: Any) -> dict:
    """A gates document checked and completed with defaults; raises GateError naming each problem."""
    if data is None:
        # Default gates on a metric neither run has (no engine spans behind a URL target: no queue time) are
        # skipped; a gate asked for explicitly is inconclusive instead.
        return {**DEFAULT_GATES, "gates": [dict(g, default=True) for g in DEFAULT_GATES["gates"]]}
    problems: list[str] = []
    if not isinstance(data, Mapping):
        raise GateError(["the gates document must be a mapping with confidence, power and gates"])
    unknown = set(data) - {"confidence", "power", "gates"}
    if unknown:
        problems.append(f"unknown keys {', '.join(sorted(map(str, unknown)))} (use confidence, power, gates)")
    confidence = _number(data.get("confidence", 0.95), "confidence", problems, low=0.5, high=0.999)
    power = _number(data.get("power", 0.8), "power", problems, low=0.5, high=0.999)
    raw = data.get("gates", DEFAULT_GATES["gates"])
    if not isinstance(raw, list) or not raw or len(raw) > 50:
        problems.append("gates must be a list of 1-50 gates")
        raw = []
    gates = []
    for index, gate in enumerate(raw):
        where = f"gates[{index}]"
        if not isinstance(gate, Mapping):
            problems.append(f"{where} must be a mapping")
            continue
        metric = gate.get("metric")
        if metric in LATENCY_METRICS:
            allowed = {"metric", "stat", "max_increase_pct", "max_increase_ms"}
            out = {"metric": metric, "stat": gate.get("stat", "p95")}
            if out["stat"] not in STATS:
                problems.append(f"{where}.stat must be one of {', '.join(STATS)} (got {out['stat']!r})")
            if "max_increase_pct" not in gate and "max_increase_ms" not in gate:
                problems.append(f"{where} needs max_increase_pct and/or max_increase_ms")
            for key, high in (("max_increase_pct", 10_000), ("max_increase_ms", 3_600_000)):
                if key in gate:
                    out[key] = _number(gate[key], f"{where}.{key}", problems, low=0, high=high)
        elif metric in ("pass_rate", "error_rate"):
            key = "max_decrease" if metric == "pass_rate" else "max_increase"
            allowed = {"metric", key} | ({"evaluator"} if metric == "pass_rate" else set())
            out = {"metric": metric, key: _number(gate.get(key, 0 if metric == "pass_rate" else 1),
                                                   f"{where}.{key}", problems, low=0, high=100)}
            if "evaluator" in gate:
                if not isinstance(gate["evaluator"], str) or not gate["evaluator"]:
                    problems.append(f"{where}.evaluator must be an evaluator's name")
                out["evaluator"] = gate["evaluator"]
        elif metric == "consistency":
            allowed = {"metric", "min"}
            out = {"metric": metric, "min": _number(gate.get("min", 100), f"{where}.min", problems, low=0, high=100)}
        else:
            problems.append(f"{where}.metric: unknown metric {metric!r}; use one of "
                            f"{', '.join(LATENCY_METRICS + QUALITY_METRICS)}")
            continue
        extra = set(gate) - allowed
        if extra:
            problems.append(f"{where}: unknown keys {', '.join(sorted(map(str, extra)))} for {metric}")
        gates.append(out)
    if problems:
        raise GateError(problems)
    return {"confidence": confidence, "power": power, "gates": gates}


# -- samples -------------------------------------------------------------------------------------------------
def _key(result: Mapping) -> tuple[str, int]:
    return (result["item_id"], result.get("repetition", 0))


def _value(result: Mapping, metric: str) -> float | None:
    value = (result.get("metrics") or {}).get(metric)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def samples(baseline: list[dict], candidate: list[dict], metric: str, *, paired: bool
            ) -> tuple[list[float], list[float]]:
    """The values of `metric` of the successful requests: aligned by (item, repetition) when paired."""
    if paired:
        base = {_key(r): _value(r, metric) for r in baseline if r["success"]}
        xs, ys = [], []
        for r in candidate:
            if not r["success"]:
                continue
            x = base.get(_key(r))
            y = _value(r, metric)
            if x is not None and y is not None:
                xs.append(x)
                ys.append(y)
        return xs, ys
    xs = [v for r in baseline if r["success"] and (v := _value(r, metric)) is not None]
    ys = [v for r in candidate if r["success"] and (v := _value(r, metric)) is not None]
    return xs, ys


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "mean": None}
    return {"n": len(values), "p50": stats.quantile(values, 0.5), "p95": stats.quantile(values, 0.95),
            "p99": stats.quantile(values, 0.99), "mean": sum(values) / len(values)}


def metric_table(baseline: list[dict], candidate: list[dict], *, paired: bool, confidence: float, seed: int,
                 metrics: Iterable[str] = LATENCY_METRICS, resamples: int = 300) -> list[dict]:
    rows = []
    for metric in metrics:
        xs, ys = samples(baseline, candidate, metric, paired=paired)
        if not xs and not ys:
            continue
        test, p = stats.rank_test(xs, ys, paired=paired)
        hl = stats.hodges_lehmann(xs, ys, paired=paired, seed=seed)
        interval = stats.hodges_lehmann_interval(xs, ys, paired=paired, confidence=confidence, seed=seed,
                                                 n_resamples=resamples)
        rows.append({"metric": metric, "test": test, "p_value": p, "hl_shift": hl,
                     "hl_ci": interval.as_list() if interval else None,
                     "baseline": _quantiles(xs), "candidate": _quantiles(ys)})
    return rows


# -- gates ---------------------------------------------------------------------------------------------------
def latency_gate(gate: dict, baseline: list[dict], candidate: list[dict], *, paired: bool, confidence: float,
                 power_target: float, seed: int) -> dict:
    metric, stat = gate["metric"], gate["stat"]
    xs, ys = samples(baseline, candidate, metric, paired=paired)
    alpha = 1.0 - confidence
    test, p = stats.rank_test(xs, ys, paired=paired)
    of = stats.statistic_of(stat)
    base = float(of(stats.as_array(xs))) if xs else None
    cand = float(of(stats.as_array(ys))) if ys else None
    out = {"metric": metric, "stat": stat, "baseline": base, "candidate": cand, "test": test, "p_value": p,
           "n": min(len(xs), len(ys)), "shift": None, "shift_pct": None, "ci": None, "threshold": None,
           "power": None, "needed_items": None}
    if not xs and not ys and gate.get("default"):
        out.update(verdict="skipped", passed=None, reason=f"no values of {metric} in either run")
        return out
    minimum = min_items(stat)
    if base is None or cand is None or min(len(xs), len(ys)) < minimum:
        out.update(verdict="inconclusive", passed=None,
                   reason=f"{min(len(xs), len(ys))} value(s) of {metric} per arm; a {stat} needs at least {minimum}")
        return out
    threshold = max(gate.get("max_increase_pct", 0.0) / 100.0 * abs(base), gate.get("max_increase_ms", 0.0))
    shift = cand - base
    interval = stats.bootstrap_interval(xs, ys, stats.shift_statistic(stat), paired=paired,
                                        confidence=1.0 - 2.0 * alpha, seed=seed)
    low, high, se = interval.low, interval.high, interval.standard_error
    power = stats.power(threshold, se, alpha=alpha) if threshold > 0 else None
    n = min(len(xs), len(ys))
    out.update(shift=shift, shift_pct=(shift / base * 100.0) if base else None, ci=[low, high],
               threshold=threshold, power=power, standard_error=se)
    tolerance = _tolerance_text(gate, threshold)
    if low > 0 and shift > threshold:
        out.update(verdict="fail", passed=False, reason=(
            f"{stat} {metric} rose from {base:.1f} to {cand:.1f} ms ({_pct(shift, base)}), more than {tolerance}; "
            f"{confidence:.0%} interval of the rise [{low:.1f}, {high:.1f}] ms, {test} p={_p(p)}"))
    elif high <= threshold and (power is None or power >= power_target):
        out.update(verdict="pass", passed=True, reason=(
            f"{stat} {metric} {base:.1f} → {cand:.1f} ms; the rise is at most {high:.1f} ms with {confidence:.0%} "
            f"confidence, within {tolerance}"))
    else:
        needed = stats.required_sample(n, threshold, se, alpha=alpha, target=power_target) if threshold > 0 else None
        out.update(verdict="inconclusive", passed=None, needed_items=needed, reason=(
            f"{stat} {metric} {base:.1f} → {cand:.1f} ms; interval of the rise [{low:.1f}, {high:.1f}] ms includes "
            f"the tolerance ({tolerance}): with {n} item(s) the power to detect a rise of {threshold:.1f} ms is "
            f"{(power or 0):.0%}" + (f"; about {needed} items would give {power_target:.0%}" if needed else "")))
    return out


def _tolerance_text(gate: dict, threshold: float) -> str:
    parts = []
    if gate.get("max_increase_pct"):
        parts.append(f"{gate['max_increase_pct']:g}%")
    if gate.get("max_increase_ms"):
        parts.append(f"{gate['max_increase_ms']:g} ms")
    return f"{' / '.join(parts) or '0'} = {threshold:.1f} ms"


def _pct(shift: float, base: float) -> str:
    return f"{shift / base * 100.0:+.0f}%" if base else f"{shift:+.1f} ms"


def _p(p: float | None) -> str:
    return "n/a" if p is None else (f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}")


def _binary_gate(name: str, base_flags: dict, cand_flags: dict, *, paired: bool, alpha: float, worse_if: str,
                 tolerance: float) -> dict:
    """A gate on a rate of True flags. worse_if='drop' (pass rate) or 'rise' (error rate); tolerance in points."""
    if paired:
        keys = [k for k in cand_flags if k in base_flags]
        xs = [base_flags[k] for k in keys]
        ys = [cand_flags[k] for k in keys]
        b = sum(1 for x, y in zip(xs, ys) if x and not y)
        c = sum(1 for x, y in zip(xs, ys) if not x and y)
        p = stats.mcnemar(b, c)
        test = "mcnemar"
    else:
        xs, ys = list(base_flags.values()), list(cand_flags.values())
        p = stats.fisher(sum(xs), len(xs), sum(ys), len(ys))
        test = "fisher"
        b = c = None
    out = {"metric": name, "test": test, "p_value": p, "n": min(len(xs), len(ys)), "discordant": [b, c]
           if paired else None}
    if not xs or not ys:
        out.update(baseline=None, candidate=None, verdict="inconclusive", passed=None, shift=None,
                   reason=f"no {name.replace('_', ' ')} to compare")
        return out
    base_rate, cand_rate = 100.0 * sum(xs) / len(xs), 100.0 * sum(ys) / len(ys)
    change = (base_rate - cand_rate) if worse_if == "drop" else (cand_rate - base_rate)
    out.update(baseline=base_rate, candidate=cand_rate, shift=cand_rate - base_rate, threshold=tolerance)
    words = f"{name.replace('_', ' ')} {base_rate:.1f}% → {cand_rate:.1f}%"
    if change > tolerance and p < alpha:
        out.update(verdict="fail", passed=False,
                   reason=f"{words}: {'down' if worse_if == 'drop' else 'up'} {change:.1f} points "
                          f"(more than {tolerance:g}), {test} p={_p(p)}")
    elif min(len(xs), len(ys)) < MIN_ITEMS:
        out.update(verdict="inconclusive", passed=None,
                   reason=f"{words}: {min(len(xs), len(ys))} item(s) to compare; at least {MIN_ITEMS} are needed")
    elif change > tolerance:
        out.update(verdict="pass", passed=True,
                   reason=f"{words}: a change of {change:.1f} points, not significant ({test} p={_p(p)})")
    else:
        out.update(verdict="pass", passed=True, reason=f"{words}, within {tolerance:g} points")
    return out


def quality_gate(gate: dict, baseline: list[dict], candidate: list[dict], *, paired: bool, alpha: float) -> dict:
    metric = gate["metric"]
    if metric == "error_rate":
        base = {_key(r): not r["success"] for r in baseline}
        cand = {_key(r): not r["success"] for r in candidate}
        out = _binary_gate("error_rate", base, cand, paired=paired, alpha=alpha, worse_if="rise",
                           tolerance=gate["max_increase"])
        rate = out.get("candidate")
        if rate is not None and rate >= 50.0:
            out.update(verdict="fail", passed=False,
                       reason=f"the candidate failed {rate:.0f}% of its requests ({sum(cand.values())} of "
                              f"{len(cand)})")
        return out
    if metric == "pass_rate":
        evaluator = gate.get("evaluator")

        def flags(results):
            out = {}
            for r in results:
                if evaluator:
                    score = (r.get("scores") or {}).get(evaluator)
                    if score is not None:
                        out[_key(r)] = bool(score["passed"])
                elif r.get("passed") is not None:
                    out[_key(r)] = bool(r["passed"])
                elif not r["success"] and r.get("has_evaluators"):
                    out[_key(r)] = False
            return out

        out = _binary_gate("pass_rate", flags(baseline), flags(candidate), paired=paired, alpha=alpha,
                           worse_if="drop", tolerance=gate["max_decrease"])
        if evaluator:
            out["evaluator"] = evaluator
        if out["n"] == 0:
            out.update(verdict="pass", passed=True, reason="no item has an evaluator: nothing to compare")
        return out
    # consistency: the candidate's output equals the baseline's
    scores = [(r.get("scores") or {}).get("consistency") for r in candidate if r["success"]]
    scores = [s for s in scores if s is not None]
    out = {"metric": "consistency", "n": len(scores), "baseline": 100.0, "test": None, "p_value": None}
    if not scores:
        out.update(candidate=None, verdict="inconclusive", passed=None,
                   reason="no output to compare with a baseline output (consistency needs a paired run)")
        return out
    rate = 100.0 * sum(1 for s in scores if s["passed"]) / len(scores)
    ok = rate >= gate["min"]
    out.update(candidate=rate, threshold=gate["min"], verdict="pass" if ok else "fail", passed=ok,
               reason=f"{rate:.1f}% of outputs equal the baseline's (at least {gate['min']:g}% required)")
    return out


def compare(baseline: list[dict], candidate: list[dict], config: dict, *, paired: bool, seed: int = 0) -> dict:
    """The whole comparison: gates and verdict, per-metric tests overall and per prompt bucket, quality."""
    confidence, power_target = config["confidence"], config["power"]
    gate_results = []
    for gate in config["gates"]:
        if gate["metric"] in LATENCY_METRICS:
            gate_results.append(latency_gate(gate, baseline, candidate, paired=paired, confidence=confidence,
                                             power_target=power_target, seed=seed))
        else:
            gate_results.append(quality_gate(gate, baseline, candidate, paired=paired, alpha=1.0 - confidence))
    verdicts = [g["verdict"] for g in gate_results]
    verdict = "fail" if "fail" in verdicts else ("inconclusive" if "inconclusive" in verdicts else "pass")
    overall = metric_table(baseline, candidate, paired=paired, confidence=confidence, seed=seed)
    by_bucket: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for r in baseline:
        by_bucket[r.get("prompt_bucket") or "unknown"][0].append(r)
    for r in candidate:
        by_bucket[r.get("prompt_bucket") or "unknown"][1].append(r)
    buckets = {bucket: metric_table(b, c, paired=paired, confidence=confidence, seed=seed, resamples=150,
                                    metrics=("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms"))
               for bucket, (b, c) in sorted(by_bucket.items())}
    _explain(gate_results, overall)
    return {"verdict": verdict, "paired": paired, "confidence": confidence, "power_target": power_target,
            "gates": gate_results, "metrics": overall, "buckets": buckets,
            "quality": quality_table(baseline, candidate, paired=paired)}


def _explain(gates: list[dict], table: list[dict]) -> None:
    """A failed end-to-end metric names the component whose median moved most (Hodges–Lehmann)."""
    moved = [(row["hl_shift"], row["metric"]) for row in table
             if row["metric"] in COMPONENTS and row["hl_shift"] is not None]
    if not moved:
        return
    shift, component = max(moved)
    for gate in gates:
        if gate["verdict"] == "fail" and gate["metric"] in ("ttft_ms", "e2e_ms", "tpot_ms", "itl_ms") and shift > 0:
            gate["cause"] = component
            gate["reason"] += f"; most of it is {component.removesuffix('_ms')} time (median +{shift:.1f} ms)"


def quality_table(baseline: list[dict], candidate: list[dict], *, paired: bool) -> list[dict]:
    """Per evaluator: pass rates and mean scores of both arms, McNemar (paired) or Fisher p-value."""
    names = sorted({name for r in baseline + candidate for name in (r.get("scores") or {})})
    rows = []
    for name in names:
        def collect(results):
            return {_key(r): r["scores"][name] for r in results if name in (r.get("scores") or {})}

        base, cand = collect(baseline), collect(candidate)
        row = {"evaluator": name, "baseline_n": len(base), "candidate_n": len(cand)}
        for arm, data in (("baseline", base), ("candidate", cand)):
            row[f"{arm}_pass_rate"] = 100.0 * sum(s["passed"] for s in data.values()) / len(data) if data else None
            row[f"{arm}_mean_score"] = sum(s["score"] for s in data.values()) / len(data) if data else None
        if paired:
            keys = [k for k in cand if k in base]
            b = sum(1 for k in keys if base[k]["passed"] and not cand[k]["passed"])
            c = sum(1 for k in keys if not base[k]["passed"] and cand[k]["passed"])
            row.update(test="mcnemar", p_value=stats.mcnemar(b, c) if keys else None, discordant=[b, c])
            score_x = [base[k]["score"] for k in keys]
            score_y = [cand[k]["score"] for k in keys]
            row["score_test"], row["score_p_value"] = stats.rank_test(score_x, score_y, paired=True)
        elif base and cand:
            row.update(test="fisher", p_value=stats.fisher(sum(s["passed"] for s in base.values()), len(base),
                                                           sum(s["passed"] for s in cand.values()), len(cand)))
            row["score_test"], row["score_p_value"] = stats.rank_test(
                [s["score"] for s in base.values()], [s["score"] for s in cand.values()], paired=False)
        rows.append(row)
    return rows
