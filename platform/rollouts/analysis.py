"""Canary analysis: one look at a canary step, the canary group's requests against the baseline group's over the
same span, read from ClickHouse by replica group.

Per latency metric (TTFT, TPOT, e2e, queue, prefill, decode), as Kayenta judges a canary but on every request
rather than on pre-aggregated series: the Mann–Whitney U test and the Hodges–Lehmann shift (canary − baseline)
with its distribution-free (Moses) confidence interval at the look's level (alpha split over the metrics). With T
the tolerance (``tolerance`` × the baseline's median, at least ``min_shift_ms``), M the minimum detectable
effect (``mde`` × the baseline's median, at least T) and E the change the rollout is expected to make (``expected``
× the baseline's median, 0 by default; a loop sets it from its study's prediction, e.g. TPOT +20% for a config that
batches more sequences), each shift is judged beyond E:

- **fail** when the interval lies wholly beyond T in the bad direction (the canary is worse by more than the
  tolerance, with the look's confidence);
- **pass** when the interval's bad end is below M (the data rule out a shift as large as the MDE);
- otherwise **inconclusive**: too few requests to tell, with the canary requests a pass would need.

A step passes when every ``must_pass`` metric (default TTFT, TPOT, queue time), the error rate and the SLOs pass;
any metric can fail it.

Fewer than ``min_requests`` requests on either side never give a verdict. Error rate: Fisher's exact test
(one-sided), fail when the canary fails more often (p < alpha) by more than its tolerance. SLOs of the project
scoped to the group: fail when the canary burns one's error budget faster than ``burn_factor`` and faster than the
baseline (Fisher, p < alpha).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import math
from typing import Any

import numpy as np
from regressions import stats

from . import queries
from .plan import LATENCY_METRICS, METRIC_LABELS

QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
MAX_ROWS_PER_GROUP = 20_000
MAX_PAIRS = 400_000  # pairwise differences of the Hodges–Lehmann interval (the baseline is subsampled above it)
# What explains a latency metric's shift: its components in the decomposition.
COMPONENTS = {"ttft_ms": ("queue_ms", "prefill_ms"), "e2e_ms": ("queue_ms", "prefill_ms", "decode_ms"),
              "tpot_ms": ("decode_ms",)}


@dataclasses.dataclass
class Sample:
    """One side's requests: latency values per metric (ok requests only) and counts."""

    total: int = 0
    errors: int = 0
    values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def fetch(store, project_id: int, groups: tuple[str, str], since: dt.datetime, until: dt.datetime
          ) -> dict[str, Sample]:
    """{group: Sample} of the two groups' requests that arrived in [since, until)."""
    rows = queries.group_requests(store, project_id, groups, since, until, limit=2 * MAX_ROWS_PER_GROUP)
    collected: dict[str, dict[str, list[float]]] = {g: {m: [] for m in LATENCY_METRICS} for g in groups}
    samples = {g: Sample() for g in groups}
    for row in rows:
        group, status = row[0], row[1]
        if group not in samples:
            continue
        sample = samples[group]
        sample.total += 1
        if status != "ok":
            sample.errors += 1
            continue
        for metric, value in zip(LATENCY_METRICS, row[2:]):
            if value is not None and math.isfinite(value):
                collected[group][metric].append(float(value))
    for group, sample in samples.items():
        sample.values = {m: np.asarray(v, dtype=float) for m, v in collected[group].items()}
    return samples


def hl_interval(baseline: np.ndarray, canary: np.ndarray, confidence: float, seed: int = 0
                ) -> tuple[float, float, float]:
    """(Hodges–Lehmann shift canary − baseline, low, high): the median of the pairwise differences and Moses'
    distribution-free interval (order statistics of the differences at the Mann–Whitney critical value). The
    baseline is subsampled when the pairs would exceed MAX_PAIRS; the interval is then for the subsample
    (wider, so conservative)."""
    if canary.size * baseline.size > MAX_PAIRS:
        keep = max(1, MAX_PAIRS // max(1, canary.size))
        baseline = np.random.default_rng(seed).choice(baseline, size=min(keep, baseline.size), replace=False)
    m, n = canary.size, baseline.size
    diffs = np.sort(np.subtract.outer(canary, baseline).ravel())
    total = diffs.size
    shift = float(np.median(diffs))
    z = stats.z_of(1.0 - (1.0 - confidence) / 2.0)
    k = int(math.floor(total / 2.0 - z * math.sqrt(m * n * (m + n + 1) / 12.0)))
    if k < 0:
        return shift, -math.inf, math.inf
    return shift, float(diffs[k]), float(diffs[total - 1 - k])


def _q(values: np.ndarray, q: float) -> float | None:
    return float(np.quantile(values, q)) if values.size else None


def judge_metric(spec: dict, baseline: np.ndarray, canary: np.ndarray, *, alpha: float, mde: float, power: float,
                 min_requests: int) -> dict:
    """One metric's figures and verdict (pass / fail / inconclusive)."""
    metric = spec["metric"]
    statistic = spec.get("statistic", "p95")
    q = float(statistic[1:]) / 100.0
    out: dict[str, Any] = {
        "metric": metric, "label": METRIC_LABELS[metric], "direction": spec["direction"], "statistic": statistic,
        "must_pass": spec.get("must_pass", True),
        "n_baseline": int(baseline.size), "n_canary": int(canary.size),
        "baseline": _q(baseline, q), "canary": _q(canary, q),
        "baseline_median": _q(baseline, 0.5), "canary_median": _q(canary, 0.5),
        "baseline_mean": float(baseline.mean()) if baseline.size else None,
        "canary_mean": float(canary.mean()) if canary.size else None,
        "quantiles": {"q": list(QUANTILES), "baseline": [_q(baseline, x) for x in QUANTILES],
                      "canary": [_q(canary, x) for x in QUANTILES]},
    }
    if canary.size < min_requests or baseline.size < min_requests:
        out.update(verdict="inconclusive", why=f"{canary.size} canary and {baseline.size} baseline requests; "
                                               f"a verdict needs at least {min_requests} of each")
        out["needed"] = min_requests
        return out
    median = max(abs(out["baseline_median"] or 0.0), 0.0)
    tolerance = max(spec["tolerance"] * median, spec["min_shift_ms"])
    detectable = max(mde * median, tolerance)
    expected = spec.get("expected", 0.0) * median
    shift, low, high = hl_interval(baseline, canary, 1.0 - alpha)
    _, p = stats.rank_test(baseline, canary, paired=False)
    out.update(hl_shift=shift, ci=[low, high], p=p, tolerance_ms=tolerance, mde_ms=detectable,
               confidence=1.0 - alpha)
    if expected:
        out["expected_ms"] = expected
    direction = spec["direction"]
    worse_up = direction in ("increase", "either")
    worse_down = direction in ("decrease", "either")
    if (worse_up and low - expected > tolerance) or (worse_down and high - expected < -tolerance):
        out["verdict"] = "fail"
        return out
    ruled_out = (not worse_up or high - expected < detectable) and (not worse_down or low - expected > -detectable)
    if ruled_out:
        out["verdict"] = "pass"
        return out
    out["verdict"] = "inconclusive"
    half = (high - low) / 2.0 if math.isfinite(high - low) else math.inf
    se = half / stats.z_of(1.0 - alpha / 2.0) if math.isfinite(half) else math.inf
    needed = stats.required_sample(int(canary.size), detectable, se, alpha=alpha / 2.0, target=power) \
        if math.isfinite(se) else None
    out["needed"] = needed
    beyond = f" beyond the expected {_signed(expected)}" if expected else ""
    out["why"] = (f"{canary.size} canary requests cannot rule out a {_ms(detectable)} shift{beyond} "
                  f"(interval [{_ms(low)}, {_ms(high)}])"
                  + (f"; about {needed} are needed" if needed else ""))
    return out


def judge_errors(spec: dict, baseline: Sample, canary: Sample, *, alpha: float, min_requests: int) -> dict:
    out: dict[str, Any] = {"n_baseline": baseline.total, "n_canary": canary.total, "errors_baseline": baseline.errors,
                           "errors_canary": canary.errors,
                           "rate_baseline": baseline.errors / baseline.total if baseline.total else None,
                           "rate_canary": canary.errors / canary.total if canary.total else None,
                           "tolerance": spec["tolerance"]}
    if canary.total < min_requests or baseline.total < min_requests:
        out.update(verdict="inconclusive", why=f"{canary.total} canary requests (at least {min_requests} needed)")
        return out
    p = float(stats.sps.fisher_exact([[canary.errors, canary.total - canary.errors],
                                      [baseline.errors, baseline.total - baseline.errors]],
                                     alternative="greater").pvalue)
    out["p"] = p
    worse = out["rate_canary"] - out["rate_baseline"]
    out["verdict"] = "fail" if p < alpha and worse > spec["tolerance"] else "pass"
    return out


def judge_slos(slos: list[dict], baseline_rows: Sample, canary_rows: Sample, *, alpha: float, burn_factor: float,
               min_requests: int) -> list[dict]:
    """Each SLO scoped to the group, on the canary's requests against the baseline's."""
    results = []
    for slo in slos:
        def bad(sample: Sample) -> tuple[int, int]:
            if slo["sli"] == "error_ratio":
                return sample.errors, sample.total
            values = sample.values.get(slo["sli"], np.asarray([]))
            return int(np.sum(values > slo["threshold_ms"])), int(values.size)
        bad_c, n_c = bad(canary_rows)
        bad_b, n_b = bad(baseline_rows)
        budget = 1.0 - slo["objective"]
        burn_c = (bad_c / n_c) / budget if n_c else None
        burn_b = (bad_b / n_b) / budget if n_b else None
        out = {"slo": slo["name"], "sli": slo["sli"], "threshold_ms": slo.get("threshold_ms"),
               "objective": slo["objective"], "bad_canary": bad_c, "n_canary": n_c, "bad_baseline": bad_b,
               "n_baseline": n_b, "burn_canary": burn_c, "burn_baseline": burn_b, "burn_factor": burn_factor}
        if n_c < min_requests or n_b < min_requests:
            out.update(verdict="inconclusive", why=f"{n_c} canary requests (at least {min_requests} needed)")
        else:
            p = float(stats.sps.fisher_exact([[bad_c, n_c - bad_c], [bad_b, n_b - bad_b]],
                                             alternative="greater").pvalue)
            out["p"] = p
            out["verdict"] = "fail" if burn_c > burn_factor and p < alpha else "pass"
        results.append(out)
    return results


def analyse(samples: dict[str, Sample], *, baseline_group: str, canary_group: str, config: dict,
            slos: list[dict] | None = None) -> dict:
    """The look's verdict and every figure: {"verdict", "reason", "metrics", "errors", "slos", "counts"}."""
    baseline, canary = samples[baseline_group], samples[canary_group]
    metrics = config["metrics"]
    checks = len(metrics) + int(config["error_rate"]["enabled"]) + (len(slos or []) if config["slo"]["enabled"]
                                                                    else 0)
    alpha = config["alpha"] / max(1, checks)
    table = [judge_metric(spec, baseline.values[spec["metric"]], canary.values[spec["metric"]], alpha=alpha,
                          mde=config["mde"], power=config["power"], min_requests=config["min_requests"])
             for spec in metrics]
    # Mean shifts add up (TTFT = queue + prefill + overheads, request by request): they say which component
    # explains a failing metric, judged or not.
    shifts = {m: float(canary.values[m].mean() - baseline.values[m].mean())
              for m in LATENCY_METRICS if baseline.values[m].size and canary.values[m].size}
    for row in table:
        if row["verdict"] == "fail":
            row["explained_by"] = explain(row, shifts)
    errors = judge_errors(config["error_rate"], baseline, canary, alpha=alpha,
                          min_requests=config["min_requests"]) if config["error_rate"]["enabled"] else None
    slo_results = judge_slos(slos or [], baseline, canary, alpha=alpha, burn_factor=config["slo"]["burn_factor"],
                             min_requests=config["min_requests"]) if config["slo"]["enabled"] else []
    verdicts = [row["verdict"] for row in table] + ([errors["verdict"]] if errors else []) + \
        [s["verdict"] for s in slo_results]
    # What must pass for the step to pass: the metrics marked must_pass, the error rate, the SLOs (the others may
    # only fail it).
    required = [row["verdict"] for row in table if row.get("must_pass", True)] + \
        ([errors["verdict"]] if errors else []) + [s["verdict"] for s in slo_results]
    if "fail" in verdicts:
        verdict = "fail"
    elif required and all(v == "pass" for v in required):
        verdict = "pass"
    else:
        verdict = "inconclusive"
    result = {"verdict": verdict, "alpha_per_check": alpha, "metrics": table, "errors": errors,
              "slos": slo_results, "counts": {"baseline": baseline.total, "canary": canary.total,
                                              "baseline_errors": baseline.errors, "canary_errors": canary.errors}}
    result["reason"] = reason_of(result)
    return result


def explain(row: dict, shifts: dict[str, float]) -> dict | None:
    """The component of the decomposition whose mean shift explains most of a failing metric's mean shift."""
    total = shifts.get(row["metric"])
    if not total or total <= 0:
        return None
    best = None
    for component in COMPONENTS.get(row["metric"], ()):
        shift = shifts.get(component)
        if shift is not None and shift > 0 and (best is None or shift > best[1]):
            best = (component, shift)
    if best is None:
        return None
    return {"component": best[0], "label": METRIC_LABELS[best[0]], "mean_shift_ms": best[1],
            "metric_mean_shift_ms": total, "share": min(1.0, best[1] / total)}


def _ms(value: float | None) -> str:
    if value is None:
        return "?"
    if not math.isfinite(value):
        return "∞" if value > 0 else "−∞"
    return f"{value:.0f} ms" if abs(value) >= 10 else f"{value:.1f} ms"


def _signed(value: float) -> str:
    text = _ms(abs(value))
    return ("+" if value >= 0 else "−") + text


def _p_text(p: float | None) -> str:
    if p is None:
        return "p ?"
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def metric_sentence(row: dict) -> str:
    """E.g. "TTFT p95 +210 ms (baseline 180 ms, canary 390 ms, HL shift 195 ms [160, 230], p < 0.001); queue
    time explains 92% of it"."""
    label = {"e2e_ms": "E2E latency"}.get(row["metric"], METRIC_LABELS[row["metric"]])
    label = label[0].upper() + label[1:]
    base, can = row.get("baseline"), row.get("canary")
    delta = (can - base) if base is not None and can is not None else None
    text = f"{label} {row['statistic']} {_signed(delta) if delta is not None else '?'}"
    if "hl_shift" in row:
        low, high = row["ci"]
        text += (f" (baseline {_ms(base)}, canary {_ms(can)}, HL shift {_ms(row['hl_shift'])} "
                 f"[{_ms(low).removesuffix(' ms')}, {_ms(high)}], {_p_text(row.get('p'))}; tolerance "
                 f"{_ms(row['tolerance_ms'])}"
                 + (f" beyond the expected {_signed(row['expected_ms'])}" if row.get("expected_ms") else "") + ")")
    explained = row.get("explained_by")
    if explained:
        text += f"; {explained['label']} explains {explained['share'] * 100:.0f}% of it"
    return text


def reason_of(result: dict) -> str:
    """One paragraph: why the look came out as it did, with the values."""
    verdict = result["verdict"]
    parts: list[str] = []
    if verdict == "fail":
        # What users feel first (TTFT, TPOT, e2e), then the components; three at most, the largest shifts first.
        failing = sorted((r for r in result["metrics"] if r["verdict"] == "fail"),
                         key=lambda r: (r["metric"] not in ("ttft_ms", "tpot_ms", "e2e_ms"),
                                        -(r.get("hl_shift") or 0) / max(r.get("baseline_median") or 1.0, 1.0)))
        parts += [metric_sentence(r) for r in failing[:3]]
        if len(failing) > 3:
            parts.append("also " + ", ".join(METRIC_LABELS[r["metric"]] for r in failing[3:]))
        errors = result.get("errors")
        if errors and errors["verdict"] == "fail":
            parts.append(f"error rate {errors['rate_canary'] * 100:.1f}% against {errors['rate_baseline'] * 100:.1f}% "
                         f"({errors['errors_canary']}/{errors['n_canary']} vs {errors['errors_baseline']}/"
                         f"{errors['n_baseline']}, Fisher {_p_text(errors.get('p'))})")
        for slo in result.get("slos", []):
            if slo["verdict"] == "fail":
                parts.append(f"SLO {slo['slo']} burns {slo['burn_canary']:.1f}× its budget on the canary "
                             f"({slo['bad_canary']}/{slo['n_canary']} bad) against {slo['burn_baseline']:.1f}× on "
                             f"the baseline ({_p_text(slo.get('p'))})")
        return "; ".join(parts)
    if verdict == "pass":
        counts = result["counts"]
        return (f"no regression beyond tolerance on {counts['canary']} canary and {counts['baseline']} baseline "
                f"requests; every judged shift is ruled out above its minimum detectable effect")
    waiting = [f"{METRIC_LABELS[r['metric']]}: {r['why']}" for r in result["metrics"]
               if r["verdict"] == "inconclusive" and r.get("why") and r.get("must_pass", True)]
    errors = result.get("errors")
    if errors and errors["verdict"] == "inconclusive":
        waiting.append(f"error rate: {errors['why']}")
    for slo in result.get("slos", []):
        if slo["verdict"] == "inconclusive":
            waiting.append(f"SLO {slo['slo']}: {slo['why']}")
    return "not enough data: " + "; ".join(waiting[:4]) if waiting else "not enough data"
