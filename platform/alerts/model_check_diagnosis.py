"""Why an SLO on `engine_model_error` burns: the live checks of the group's engine model in the burning window, and
what the latest bad one measured (its p50 prefill-time and TPOT errors, the figures a check is judged on, and which
per-step cost moved at the same batch sizes). The request-component diagnosis (diagnosis.py) does not apply: the
events are checks of a model, not requests, and the checks already say what moved."""
from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from slo import queries
from tenancy.models import Project
from traces.store import get_store

from engine.sim import traffic_fit as F

# The figures a check is judged on (tuning/checks.py); a check written before prefill time was kept (ClickHouse
# migration 0015) was judged on its p50 TTFT, which stands in for it.
FIGURE_NAMES = {"prefill_p50_error": "p50 prefill time", "tpot_p50_error": "p50 TPOT"}
EARLIER = {"prefill_p50_error": ("ttft_p50_error", "p50 TTFT")}
LIVE_ERROR_KEYS = {"ttft_p50_error": "ttft_ms_p50", "prefill_p50_error": "prefill_ms_p50",
                   "tpot_p50_error": "tpot_ms_p50"}


def diagnose_model_checks(project_id: int, filters: Mapping, burning: tuple[dt.datetime, dt.datetime], *,
                          threshold: float, store=None) -> dict:
    """The diagnosis of the checks in the burning window of the groups `filters` selects (all when none)."""
    groups = filters.get("replica_group") or None
    if isinstance(groups, str):
        groups = [groups]
    found = queries.model_check_summary(store or get_store(), project_id, groups=groups, since=burning[0],
                                        until=burning[1], threshold=threshold)
    project = Project.objects.filter(id=project_id).values_list("name", flat=True).first() or str(project_id)
    return build_model_check_diagnosis(found, threshold=threshold, filters=filters, burning=burning, project=project)


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _figures(check: Mapping) -> str:
    """"p50 TPOT 38% under what was served, p50 prefill time 11% under" (the larger first)."""
    judged = []
    for key, name in FIGURE_NAMES.items():
        if check.get(key) is None and key in EARLIER:
            key, name = EARLIER[key]
        if check.get(key) is not None:
            judged.append((abs(check[key]), key, name))
    parts = []
    for i, (_, key, name) in enumerate(sorted(judged, reverse=True)):
        value = check[key]
        parts.append(f"{name} {abs(value):.0%} {'under' if value < 0 else 'over'}"
                     + (" what was served" if i == 0 else ""))
    return ", ".join(parts) or "no p50 figure"


def moved_most(moved: Mapping[str, float]) -> str | None:
    """The cost that moved most, if any moved by traffic_fit.MOVED_AT or more."""
    named = sorted(((abs(v), cost) for cost, v in (moved or {}).items() if abs(v) >= F.MOVED_AT and cost in F.COSTS),
                   reverse=True)
    return named[0][1] if named else None


# Where to look when a cost moved at the same batch sizes (traffic_fit.attribute tells which one did).
WHERE_TO_LOOK = {
    "decode": ("a decode step reads the weights and the KV cache, then processes each running sequence's output on the "
               "host: look for lower memory bandwidth (a throttled or degraded GPU, a changed driver) or a host CPU "
               "shared with other work"),
    "prefill": ("a prefill is compute: look for lower GPU clocks (power or thermal limits, a changed driver) or another "
                "process on the GPU"),
}


def suggestion(moved: Mapping[str, float], *, project: str, group: str) -> str:
    """What to do about a model that no longer fits its group's traffic (the drift alert's and the SLI's)."""
    cost = moved_most(moved)
    where = WHERE_TO_LOOK[cost] if cost else (
        f"no cost moved by {F.MOVED_AT:.0%} or more at the same batch sizes: the traffic may differ from the window "
        "the model was fitted on (other lengths, another share of cached prompt tokens)")
    return (f"{where[:1].upper()}{where[1:]}. If the group changed on purpose (a driver, vLLM version or host), "
            f"calibrate its model again: python manage.py engine calibrate --project {project} --group {group}. "
            f"Until a model fits, tuning studies of {group} refuse it.")


def build_model_check_diagnosis(found: list[dict], *, threshold: float, filters: Mapping,
                                burning: tuple[dt.datetime, dt.datetime], project: str) -> dict:
    """The diagnosis from the per-group summaries of slo.queries.model_check_summary (most bad checks first)."""
    checks = sum(g["checks"] for g in found)
    bad = sum(g["bad"] for g in found)
    top = found[0] if found else None
    latest_bad = top["latest_bad"] if top else None
    moved = dict(latest_bad["moved"]) if latest_bad else {}
    cost = moved_most(moved)
    if not checks:
        summary = "no live check of the engine model in the burning window (too little traffic to measure it)"
    elif latest_bad is None:
        summary = (f"{checks} live checks of the engine model in the burning window, none above {threshold:.0%}: the "
                   "bad checks that burn the budget came before it")
    else:
        summary = (f"engine model {latest_bad['model_id']} of group {top['group']} (config "
                   f"{latest_bad['config_version']}) missed its latest traffic by more than {threshold:.0%} in "
                   f"{top['bad']} of {top['checks']} live checks; the latest bad one ({latest_bad['at']}, "
                   f"{latest_bad['requests']} requests): {_figures(latest_bad)}; {F.diagnosis(moved)}")
        others = [f"{g['group']} {g['bad']} of {g['checks']}" for g in found[1:] if g["bad"]]
        if others:
            summary += f". Other groups with bad checks: {', '.join(others)}"
    return {
        "sli": queries.MODEL_ERROR_SLI,
        "threshold": threshold,
        "filters": dict(filters),
        "burning": {"since": _iso(burning[0]), "until": _iso(burning[1]), "checks": checks, "bad_checks": bad},
        "groups": found,
        "engine_model": latest_bad["model_id"] if latest_bad else None,
        "live_error": ({name: latest_bad[key] for key, name in LIVE_ERROR_KEYS.items()
                        if latest_bad.get(key) is not None} if latest_bad else None),
        "moved": moved,
        "dominant_component": cost,
        "dominant_reason": f"{F.COSTS[cost]} {moved[cost] * 100:+.0f} % at the same batch sizes" if cost else None,
        "summary": summary[:1].upper() + summary[1:],
        "suggestion": suggestion(moved, project=project, group=top["group"]) if latest_bad else None,
    }
