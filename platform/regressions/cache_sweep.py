"""A regression run's cache sweep: the gateway's semantic-cache threshold measured on a golden dataset (issue 40).

    options: {"cache_sweep": {"thresholds": [0.80, 0.85, 0.90, 0.95], "max_false_hit_rate": 1.0}}

The run replays the dataset once with the gateway's response cache bypassed (its candidate arm: the engine's own
answers and their verdicts, the sweep's baseline), then once per threshold, in dataset order and one request at a
time (an answer is stored before the next question may hit it). Each threshold's pass sends an `OpenAI-Project`
header of its own, so it has a namespace of its own in the gateway's cache and never sees the entries of another
pass or of another run, and `X-Observatory-Cache-Threshold` with its threshold (the target group's cache must say
`semantic.client_threshold: true`). A result records what answered it (the response's `X-Observatory-Cache`
header: exact_cache or semantic_cache, else engine) and the best similarity the gateway found (its span's
`observatory.cache.similarity`, read from the run's traces).

Per threshold: requests, errors, hits (answers served from the cache), hit ratio (hits / answered requests), false
hits (hits whose answer fails the item's own evaluators), false-hit rate (false hits / judged hits, the hits of
items that have evaluators), and the recommendation: the lowest threshold whose false-hit rate is within
`max_false_hit_rate` (percent), or plainly that none is. Percentages, as the rest of a run's summary.

No Django here: the service checks the option with `clean`, the execution sends the passes with `pass_headers`,
the analysis writes `report` into the run's summary, the command prints `report_lines`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from collectors.base import CACHE_CLASSES, SERVED_FROM
from engine.loadgen.client import CACHE_HEADER

ENGINE, EXACT_CACHE, SEMANTIC_CACHE = SERVED_FROM
# The gateway's other headers (engine.gateway.cache_keys; that package is not imported by the platform's runs).
THRESHOLD_HEADER = "X-Observatory-Cache-Threshold"
PROJECT_HEADER = "OpenAI-Project"
BYPASS_HEADERS = {CACHE_HEADER: "bypass"}
MAX_THRESHOLDS = 20
DEFAULT_MAX_FALSE_HIT_RATE = 1.0
MAX_LISTED_ITEMS = 20


def clean(value: object) -> tuple[dict | None, list[str]]:
    """The option checked: ({"thresholds": ascending, "max_false_hit_rate"}, []) or (None, problems); (None, [])
    when there is no sweep."""
    if value is None:
        return None, []
    if not isinstance(value, dict):
        return None, ['cache_sweep must be an object such as {"thresholds": [0.85, 0.9, 0.95]}']
    problems = []
    unknown = sorted(str(key) for key in value if key not in ("thresholds", "max_false_hit_rate"))
    if unknown:
        problems.append(f"cache_sweep: unknown keys {', '.join(unknown)} (known: max_false_hit_rate, thresholds)")
    thresholds = value.get("thresholds")
    if not isinstance(thresholds, list) or not 1 <= len(thresholds) <= MAX_THRESHOLDS:
        problems.append(f"cache_sweep.thresholds must be a list of 1 to {MAX_THRESHOLDS} similarity thresholds")
        thresholds = []
    for threshold in thresholds:
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1
                or round(threshold, 4) != threshold):
            problems.append(f"cache_sweep.thresholds: {str(threshold)[:40]!r} is not a number in (0, 1] with at "
                            "most 4 decimals")
    if not problems and len(set(thresholds)) != len(thresholds):
        problems.append("cache_sweep.thresholds: a threshold is given twice")
    rate = value.get("max_false_hit_rate", DEFAULT_MAX_FALSE_HIT_RATE)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 100:
        problems.append("cache_sweep.max_false_hit_rate must be a percentage in [0, 100]")
    if problems:
        return None, problems
    return {"thresholds": sorted(float(t) for t in thresholds), "max_false_hit_rate": float(rate)}, []


def arm_of(threshold: float) -> str:
    """The result arm of a threshold's pass: "t0.85" (at most 7 characters: 4 decimals)."""
    return f"t{threshold:g}"


def pass_headers(run_key: str, threshold: float) -> dict[str, str]:
    """The headers of a threshold's pass: its own namespace (OpenAI-Project) and its threshold."""
    return {PROJECT_HEADER: f"{run_key}-{arm_of(threshold)}", THRESHOLD_HEADER: f"{threshold:g}"}


def served_from_of(header: str | None) -> str:
    """What answered, from the response's X-Observatory-Cache header (absent: the engine)."""
    if header is None:
        return ENGINE
    return header if header in CACHE_CLASSES else "unknown"


def _percent(part: int, whole: int) -> float | None:
    return 100.0 * part / whole if whole else None


def _similarities(results: Iterable[dict]) -> list[float]:
    return [r["similarity"] for r in results
            if isinstance(r.get("similarity"), float) and math.isfinite(r["similarity"])]


def pass_row(threshold: float, results: list[dict]) -> dict:
    """One threshold's figures. A result: {"item_id", "success", "served_from", "passed", "similarity"?,
    "error"?}; `passed` is the item's own evaluators' verdict on the answer it got (None: no evaluator)."""
    answered = [r for r in results if r["success"]]
    hits = [r for r in answered if r["served_from"] in CACHE_CLASSES]
    judged = [r for r in hits if r["passed"] is not None]
    false = [r for r in judged if r["passed"] is False]
    hit_similarities, false_similarities = _similarities(hits), _similarities(false)
    row = {"threshold": threshold, "requests": len(results), "errors": len(results) - len(answered),
           "hits": len(hits), "semantic_hits": sum(1 for r in hits if r["served_from"] == SEMANTIC_CACHE),
           "exact_hits": sum(1 for r in hits if r["served_from"] == EXACT_CACHE),
           "hit_ratio": _percent(len(hits), len(answered)), "judged_hits": len(judged), "false_hits": len(false),
           "false_hit_rate": _percent(len(false), len(judged)),
           "hit_similarity_min": min(hit_similarities) if hit_similarities else None,
           "false_hit_similarity_max": max(false_similarities) if false_similarities else None,
           "false_hit_items": sorted({r["item_id"] for r in false})[:MAX_LISTED_ITEMS]}
    failed = [r for r in results if not r["success"]]
    if failed:
        row["first_error"] = (failed[0].get("error") or "")[:300]
    return row


def recommendation(rows: list[dict], max_false_hit_rate: float) -> tuple[float | None, str]:
    """(the lowest threshold whose false-hit rate is within the bound, the sentence saying so or why none is)."""
    bound = f"{max_false_hit_rate:g}%"
    qualifying = [row for row in rows if row["judged_hits"] and row["false_hit_rate"] <= max_false_hit_rate]
    if qualifying:
        row = min(qualifying, key=lambda r: r["threshold"])
        return row["threshold"], (
            f"recommended threshold {row['threshold']:g}: the lowest whose false-hit rate "
            f"({row['false_hit_rate']:.1f}%) is within {bound}; it served {row['hits']} of "
            f"{row['requests'] - row['errors']} answers from the cache (hit ratio {row['hit_ratio']:.1f}%)")
    if all(row["requests"] and row["errors"] == row["requests"] for row in rows):
        first = next((row.get("first_error") for row in rows if row.get("first_error")), "")
        return None, f"no threshold qualifies: every request of the sweep failed ({first})"
    judged = [row for row in rows if row["judged_hits"]]
    if not judged:
        return None, ("no threshold qualifies: no threshold served a hit that the items' evaluators could judge "
                      "(does the group's semantic cache say client_threshold: true, and do the items have "
                      "evaluators and paraphrases?)")
    safest = max(judged, key=lambda r: r["threshold"])
    return None, (f"no threshold qualifies: every threshold that served hits had a false-hit rate above {bound} "
                  f"(at {safest['threshold']:g}: {safest['false_hit_rate']:.1f}%, {safest['false_hits']} of "
                  f"{safest['judged_hits']} hits); try higher thresholds")


def report(baseline: list[dict], passes: list[tuple[float, list[dict]]], max_false_hit_rate: float) -> dict:
    """The sweep's report: the baseline pass (cache bypassed) for context, a row per threshold, the
    recommendation."""
    answered = [r for r in baseline if r["success"]]
    judged = [r["passed"] for r in answered if r["passed"] is not None]
    rows = [pass_row(threshold, results) for threshold, results in sorted(passes, key=lambda p: p[0])]
    recommended, sentence = recommendation(rows, max_false_hit_rate)
    return {"baseline": {"requests": len(baseline), "errors": len(baseline) - len(answered),
                         "hits": sum(1 for r in answered if r["served_from"] in CACHE_CLASSES),
                         "pass_rate": _percent(sum(judged), len(judged)), "evaluated": len(judged)},
            "thresholds": rows, "max_false_hit_rate": max_false_hit_rate, "recommended_threshold": recommended,
            "recommendation": sentence}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def report_lines(data: dict) -> list[str]:
    """The report as the command prints it."""
    base = data["baseline"]
    lines = [f"  cache sweep (semantic threshold) — baseline with the cache bypassed: {base['requests']} requests, "
             f"errors {base['errors']}, pass rate {_pct(base['pass_rate'])}",
             f"  {'threshold':>9} {'requests':>8} {'errors':>6} {'hits':>5} {'hit ratio':>9} {'false hits':>10} "
             f"{'false-hit rate':>14}"]
    for row in data["thresholds"]:
        lines.append(f"  {row['threshold']:>9g} {row['requests']:>8} {row['errors']:>6} {row['hits']:>5} "
                     f"{_pct(row['hit_ratio']):>9} {row['false_hits']:>10} {_pct(row['false_hit_rate']):>14}")
    lines.append(f"  {data['recommendation']}")
    return lines
