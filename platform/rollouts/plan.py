"""A rollout's plan: its steps and how each canary step is analysed, parsed from a plan file (YAML or JSON), the
API or the dashboard's form, every problem reported at once (``PlanError.problems``).

Steps, in order (the short forms in parentheses are accepted too):

- ``{"kind": "gate", "dataset": NAME, "version": N, "gates": {...}, "options": {...}}`` (``{"gate": {...}}``): a paired
  golden-dataset regression run, new config (the canary group, at weight 0) against the baseline (the twin, or
  the group itself); ``fail`` stops the rollout, ``inconclusive`` pauses it.
- ``{"kind": "canary", "weight": 5, "interval_seconds": 120}`` (``{"canary": 5, "interval": "2m"}``): the canary
  group takes ``weight`` % of the group's traffic (the group keeps the rest; other groups' shares are untouched)
  for the interval, judged by the analysis. ``baseline``, when given, must make 100 with ``weight``.
- ``{"kind": "approval"}`` (``"approval"``): waits for an admin's approval.
- ``{"kind": "promote"}`` (``"promote"``): the group takes the config by drain-and-replace, the canary group is
  removed, weights are restored. Always last (added when missing).

``compare_with`` (default ``twin``): the canary's requests are compared with those of a baseline twin, a group
started with the group's config on as many replicas as the canary's and given as much traffic (canary weight ≤ 50%),
or (``group``) with the group's own requests.
"""
from __future__ import annotations

import copy
import math
import re
from typing import Any

LATENCY_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms")
METRIC_LABELS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "e2e latency", "queue_ms": "queue time",
                 "prefill_ms": "prefill time", "decode_ms": "decode time"}
# The smallest shift (ms) that counts, whatever the tolerance: below it a shift is noise on any fleet.
MIN_SHIFT_MS = {"ttft_ms": 5.0, "tpot_ms": 1.0, "e2e_ms": 10.0, "queue_ms": 5.0, "prefill_ms": 5.0,
                "decode_ms": 10.0}
STATISTICS = ("p50", "p90", "p95", "p99")
# Metrics a step must see pass to pass. e2e, prefill and decode times follow the lengths of each request's prompt
# and output (tenfold spreads), so ruling out a shift in them takes far more requests: by default they can fail a
# step (a shift beyond tolerance is a regression) but their "not enough data yet" does not hold it back.
MUST_PASS = {"ttft_ms": True, "tpot_ms": True, "queue_ms": True, "e2e_ms": False, "prefill_ms": False,
             "decode_ms": False}
MAX_STEPS = 20
MAX_INTERVAL_SECONDS = 24 * 3600

DEFAULT_ANALYSIS: dict[str, Any] = {
    # Requests of the step's first seconds are left out (replicas warming, weights reaching the gateway).
    "settle_seconds": 10,
    # The least span of requests an analysis reads; a canary step must last at least settle + window.
    "window_seconds": 60,
    # Interim looks during a step (only a fail acts on them: roll back at once; a pass waits for the step's end).
    "look_every_seconds": 10,
    # Family-wise error per look, split over the metrics (Bonferroni).
    "alpha": 0.01,
    # The minimum detectable effect, relative to the baseline's median: a metric passes only once the data rule
    # out a shift this large (the confidence interval's bad end is below it); until then the step is extended.
    "mde": 0.25,
    "power": 0.8,
    # No verdict on fewer requests than this on either side, however the test comes out (sparse data misfires).
    "min_requests": 20,
    # An inconclusive step is extended by its interval this many times, then the rollout pauses.
    "max_extensions": 3,
    "metrics": [{"metric": m, "direction": "increase", "tolerance": 0.10, "statistic": "p95",
                 "min_shift_ms": MIN_SHIFT_MS[m], "must_pass": MUST_PASS[m]} for m in LATENCY_METRICS],
    # Error rate: Fisher's exact test; fails when the canary's rate is higher (p < alpha) by more than this.
    "error_rate": {"enabled": True, "tolerance": 0.01},
    # SLOs of the project scoped to the group: fail when the canary burns one's budget faster than this factor
    # (and faster than the baseline, p < alpha).
    "slo": {"enabled": True, "burn_factor": 14.4},
}
DEFAULT_CANARY_STEPS = ((5, 120), (25, 120), (50, 120))


class PlanError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def seconds(value: Any, where: str, problems: list[str]) -> float | None:
    """A duration: a number of seconds or a string such as 90s, 2m, 1h."""
    if isinstance(value, bool):
        problems.append(f"{where}: a duration (seconds, or e.g. '90s', '2m'), not {value!r}")
        return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    match = _DURATION.match(value) if isinstance(value, str) else None
    if not match:
        problems.append(f"{where}: a duration (seconds, or e.g. '90s', '2m'), not {value!r}")
        return None
    scale = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[match.group(2)]
    return float(match.group(1)) * scale


def _number(data: dict, key: str, where: str, problems: list[str], *, low: float, high: float,
            integer: bool = False, low_open: bool = False) -> Any:
    value = data.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and value <= high and (not integer or float(value).is_integer())
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        problems.append(f"{where}{key}: {'an integer' if integer else 'a number'} in {bounds}, not {value!r}")
        return None
    return int(value) if integer else float(value)


def parse_analysis(data: Any, problems: list[str]) -> dict:
    out = copy.deepcopy(DEFAULT_ANALYSIS)
    if data is None:
        return out
    if not isinstance(data, dict):
        problems.append("analysis: a mapping (settle_seconds, window_seconds, alpha, mde, min_requests, metrics, "
                        "...)")
        return out
    known = set(DEFAULT_ANALYSIS)
    for key in sorted(set(data) - known):
        problems.append(f"analysis: unknown key {key!r}; known: {', '.join(sorted(known))}")
    for key in ("settle_seconds", "window_seconds", "look_every_seconds"):
        if key in data:
            value = seconds(data[key], f"analysis.{key}", problems)
            if value is not None:
                if not (0 if key == "settle_seconds" else 1) <= value <= 3600:
                    problems.append(f"analysis.{key}: between {0 if key == 'settle_seconds' else 1} s and 1 h")
                else:
                    out[key] = value
    for key, low, high, integer, low_open in (("alpha", 0, 0.5, False, True), ("mde", 0, 10, False, True),
                                              ("power", 0.5, 0.999, False, False),
                                              ("min_requests", 5, 100000, True, False),
                                              ("max_extensions", 0, 20, True, False)):
        if key in data:
            value = _number(data, key, "analysis.", problems, low=low, high=high, integer=integer, low_open=low_open)
            if value is not None:
                out[key] = value
    if "metrics" in data:
        metrics = data["metrics"]
        if not isinstance(metrics, list):
            problems.append("analysis.metrics: a list of {metric, direction, tolerance, statistic, min_shift_ms}")
        else:
            parsed = []
            for i, item in enumerate(metrics):
                where = f"analysis.metrics[{i}]."
                item = {"metric": item} if isinstance(item, str) else item
                if not isinstance(item, dict) or item.get("metric") not in LATENCY_METRICS:
                    problems.append(f"{where}metric: one of {', '.join(LATENCY_METRICS)}")
                    continue
                name = item["metric"]
                for key in sorted(set(item) - {"metric", "direction", "tolerance", "statistic", "min_shift_ms",
                                               "must_pass", "expected"}):
                    problems.append(f"{where}{key}: unknown; use direction, tolerance, statistic, min_shift_ms, "
                                    f"must_pass, expected")
                metric = {"metric": name, "direction": "increase", "tolerance": 0.10, "statistic": "p95",
                          "min_shift_ms": MIN_SHIFT_MS[name], "must_pass": MUST_PASS[name]}
                if "must_pass" in item:
                    if not isinstance(item["must_pass"], bool):
                        problems.append(f"{where}must_pass: true (the step passes only once it passes) or false "
                                        f"(it can only fail the step)")
                    else:
                        metric["must_pass"] = item["must_pass"]
                if "direction" in item:
                    if item["direction"] not in ("increase", "decrease", "either"):
                        problems.append(f"{where}direction: increase (higher is worse), decrease or either")
                    else:
                        metric["direction"] = item["direction"]
                if "statistic" in item:
                    if item["statistic"] not in STATISTICS:
                        problems.append(f"{where}statistic (the percentile reported): one of {', '.join(STATISTICS)}")
                    else:
                        metric["statistic"] = item["statistic"]
                for key, low, high in (("tolerance", 0, 10.0), ("min_shift_ms", 0, 1e6), ("expected", -0.9, 10.0)):
                    if key in item:
                        value = _number(item, key, where, problems, low=low, high=high)
                        if value is not None:
                            metric[key] = value
                parsed.append(metric)
            names = [m["metric"] for m in parsed]
            for name in sorted({n for n in names if names.count(n) > 1}):
                problems.append(f"analysis.metrics: {name} appears more than once")
            out["metrics"] = parsed
    for key in ("error_rate", "slo"):
        if key in data:
            value = data[key]
            if isinstance(value, bool):
                out[key] = {**out[key], "enabled": value}
            elif isinstance(value, dict):
                allowed = {"enabled", "tolerance"} if key == "error_rate" else {"enabled", "burn_factor"}
                for extra in sorted(set(value) - allowed):
                    problems.append(f"analysis.{key}.{extra}: unknown; use {', '.join(sorted(allowed))}")
                if "enabled" in value and not isinstance(value["enabled"], bool):
                    problems.append(f"analysis.{key}.enabled: true or false")
                merged = {**out[key], **{k: v for k, v in value.items() if k in allowed}}
                if key == "error_rate" and "tolerance" in value:
                    _number(value, "tolerance", f"analysis.{key}.", problems, low=0, high=1)
                if key == "slo" and "burn_factor" in value:
                    _number(value, "burn_factor", f"analysis.{key}.", problems, low=1, high=10000)
                out[key] = merged
            else:
                problems.append(f"analysis.{key}: true, false or a mapping")
    above = [f"{m['metric']} ({m['tolerance']:g})" for m in out["metrics"] if m["tolerance"] > out["mde"]]
    if above:
        problems.append(f"analysis: the tolerance of {', '.join(above)} is above the minimum detectable effect mde "
                        f"({out['mde']:g}): such a metric could neither pass nor fail on a shift between the two")
    if not out["metrics"] and not out["error_rate"]["enabled"] and not out["slo"]["enabled"]:
        problems.append("analysis: nothing to judge a canary on (no metrics, error rate and SLO checks off)")
    return out


def _step(item: Any, index: int, problems: list[str]) -> dict | None:
    where = f"steps[{index}]"
    if isinstance(item, str):
        item = {"kind": item}
    if not isinstance(item, dict):
        problems.append(f"{where}: a mapping such as {{kind: canary, weight: 5, interval_seconds: 120}}")
        return None
    if "kind" not in item and len(item) >= 1:  # short forms: {gate: {...}}, {canary: 5, interval: 2m}
        for kind in ("gate", "canary", "approval", "promote"):
            if kind in item:
                body = item[kind]
                rest = {k: v for k, v in item.items() if k != kind}
                if kind == "canary" and not isinstance(body, dict):
                    item = {"kind": "canary", "weight": body, **rest}
                else:
                    item = {"kind": kind, **(body if isinstance(body, dict) else {}), **rest}
                break
    kind = item.get("kind")
    if kind == "gate":
        allowed = {"kind", "dataset", "version", "gates", "options"}
        for key in sorted(set(item) - allowed):
            problems.append(f"{where}: unknown key {key!r} of a gate step; use dataset, version, gates, options")
        step = {"kind": "gate", "dataset": item.get("dataset"), "version": item.get("version"),
                "gates": item.get("gates"), "options": item.get("options")}
        if step["dataset"] is not None and (not isinstance(step["dataset"], str) or not step["dataset"].strip()):
            problems.append(f"{where}.dataset: the name of a golden dataset of the project")
        if step["version"] is not None and (isinstance(step["version"], bool) or not isinstance(step["version"], int)
                                            or step["version"] < 1):
            problems.append(f"{where}.version: a dataset version number (1, 2, ...)")
        if step["options"] is not None and not isinstance(step["options"], dict):
            problems.append(f"{where}.options: the regression run's load options (rate, repetitions, ...)")
        return step
    if kind == "canary":
        allowed = {"kind", "weight", "baseline", "interval_seconds", "interval"}
        for key in sorted(set(item) - allowed):
            problems.append(f"{where}: unknown key {key!r} of a canary step; use weight, baseline, interval_seconds")
        weight = item.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 < weight < 100:
            problems.append(f"{where}.weight: the canary's share of the group's traffic in percent, above 0 and "
                            f"below 100 (100 is promote), not {weight!r}")
            weight = None
        if "baseline" in item and weight is not None:
            baseline = item["baseline"]
            if isinstance(baseline, bool) or not isinstance(baseline, (int, float)) or \
                    abs(float(baseline) + float(weight) - 100.0) > 1e-9:
                problems.append(f"{where}: weights do not add up: canary {weight:g}% + baseline {baseline!r}% must "
                                f"be 100%")
        raw = item.get("interval_seconds", item.get("interval", 120))
        interval = seconds(raw, f"{where}.interval_seconds", problems)
        if interval is not None and not 1 <= interval <= MAX_INTERVAL_SECONDS:
            problems.append(f"{where}.interval_seconds: between 1 s and 24 h, not {interval:g}")
            interval = None
        if weight is None or interval is None:
            return None
        return {"kind": "canary", "weight": float(weight), "interval_seconds": interval}
    if kind in ("approval", "promote"):
        for key in sorted(set(item) - {"kind"}):
            problems.append(f"{where}: unknown key {key!r} of an {kind} step")
        return {"kind": kind}
    problems.append(f"{where}.kind: gate, canary, approval or promote, not {kind!r}")
    return None


# What the canary is compared with (compare_with): "twin", the baseline twin, a group of as many replicas as the canary's, started with the group's
# config at the same time and given as much traffic (like for like: same size, same load, same age; the design
# Kayenta recommends), or "group", the group itself (bigger, loaded differently, warmed up for longer).
COMPARE_WITH = ("twin", "group")


def parse_plan(data: Any, *, default_dataset: str | None = None) -> dict:
    """The normalised plan ({"steps", "analysis", "canary_replicas", "compare_with"}) or PlanError with every problem.
    ``data`` None is the default plan: a regression gate on ``default_dataset`` (when the project has one), canary
    steps 5 → 25 → 50 % of 2 minutes each, promotion."""
    problems: list[str] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PlanError(["the plan must be a mapping with steps (and optionally analysis, canary_replicas)"])
    for key in sorted(set(data) - {"steps", "analysis", "canary_replicas", "compare_with"}):
        problems.append(f"unknown key {key!r} of the plan; use steps, analysis, canary_replicas, compare_with")
    compare_with = data.get("compare_with", "twin")
    if compare_with not in COMPARE_WITH:
        problems.append(f"compare_with: {' or '.join(COMPARE_WITH)}, not {compare_with!r}")
        compare_with = "twin"
    analysis = parse_analysis(data.get("analysis"), problems)
    replicas = data.get("canary_replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 16:
        problems.append(f"canary_replicas: an integer in 1..16, not {replicas!r}")
        replicas = 1
    raw_steps = data.get("steps")
    if raw_steps is None:
        raw_steps = ([{"kind": "gate", "dataset": default_dataset}] if default_dataset else []) + [
            {"kind": "canary", "weight": w, "interval_seconds": s} for w, s in DEFAULT_CANARY_STEPS]
    if not isinstance(raw_steps, list) or not raw_steps:
        problems.append("steps: a non-empty list of gate, canary, approval and promote steps")
        raw_steps = []
    if len(raw_steps) > MAX_STEPS:
        problems.append(f"steps: at most {MAX_STEPS}")
    steps = [s for s in (_step(item, i, problems) for i, item in enumerate(raw_steps[:MAX_STEPS])) if s is not None]
    if steps and steps[-1]["kind"] != "promote":
        if any(s["kind"] == "promote" for s in steps):
            problems.append("steps: promote must be the last step (it ends the rollout)")
        else:
            steps.append({"kind": "promote"})
    elif not steps:
        steps = [{"kind": "promote"}]
    kinds = [s["kind"] for s in steps]
    if kinds.count("gate") > 1:
        problems.append("steps: at most one regression gate")
    if "gate" in kinds and kinds.index("gate") != 0:
        problems.append("steps: the regression gate comes first (before the canary takes user traffic)")
    weights = [s["weight"] for s in steps if s["kind"] == "canary"]
    if compare_with == "twin" and any(w > 50 for w in weights):
        problems.append(f"steps: compared with a baseline twin, a canary step takes at most 50% of the group's "
                        f"traffic (the twin takes as much), not {max(weights):g}%; use compare_with: group for more")
    if any(b <= a for a, b in zip(weights, weights[1:])):
        problems.append(f"steps: canary weights must increase from step to step, not {' → '.join(f'{w:g}' for w in weights)}")
    least = analysis["settle_seconds"] + analysis["window_seconds"]
    for i, step in enumerate(steps):
        if step["kind"] == "canary" and step["interval_seconds"] < least:
            problems.append(f"steps[{i}].interval_seconds: {step['interval_seconds']:g} s is too short for the "
                            f"analysis: it needs settle_seconds + window_seconds = {least:g} s")
    if problems:
        raise PlanError(problems)
    return {"steps": steps, "analysis": analysis, "canary_replicas": replicas,
            "compare_with": compare_with}


def canary_gateway_weights(base_weights: dict[str, float], group: str, canary: str, percent: float,
                           twin: str | None = None) -> dict:
    """Gateway weights giving ``canary`` ``percent`` % of what ``group`` had (and ``twin``, the baseline twin, as
    much), the rest staying with ``group``; every other group keeps its weight (so its share of the whole traffic
    is unchanged)."""
    base = float(base_weights.get(group, 0.0))
    weights = {name: float(w) for name, w in base_weights.items() if name not in (canary, twin)}
    arms = 2 if twin else 1
    weights[group] = max(0.0, base * (100.0 - arms * percent) / 100.0)
    weights[canary] = base * percent / 100.0
    if twin:
        weights[twin] = base * percent / 100.0
    return weights
