"""Validate SLO definitions (YAML items and API bodies alike) into model fields, and render SLOs back to the same form.

Every problem is reported with the field it concerns, all at once, so a YAML file is fixed in one go.
"""
from __future__ import annotations

import datetime as dt
import math
import re
from decimal import Decimal, InvalidOperation

from . import burn
from .models import LATENCY_SLIS, SLO, NoDataPolicy, Sli

FILTER_DIMENSIONS = ("service", "model", "prompt_bucket", "engine_config", "replica_group")
PROMPT_BUCKETS = ("<256", "<1k", "<4k", "<16k", ">=16k", "unknown")
PERIODS_DAYS = (28, 30)
FIELDS = (
    "name", "description", "sli", "threshold_ms", "threshold", "objective", "period", "filters", "include_cached",
    "tiers", "min_requests", "min_bad", "no_data", "repeat_interval", "labels", "enabled",
)
# engine_model_error counts live checks of a replica group's engine model: only the group selects them.
MODEL_CHECK_FILTERS = ("replica_group",)
_SLUG = re.compile(r"^[a-z0-9][a-z0-9_-]{0,99}$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]{0,63}$")
_RESERVED_LABELS = {"alertname", "slo", "project", "severity", "sli", "tier"}
MAX_FILTER_VALUES = 50
MAX_TIERS = 8
MIN_REPEAT = dt.timedelta(minutes=1)
MAX_REPEAT = dt.timedelta(days=7)


class DefinitionError(ValueError):
    """One or more problems in an SLO definition; `problems` lists them as 'field: message'."""

    def __init__(self, problems: list[str], where: str = ""):
        self.problems = problems
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(prefix + "; ".join(problems))


def parse_objective(value) -> float:
    """0.99, '0.99', '99%' or '99.9 %' → 0.99 / 0.999. A bare number ≥ 1 is refused (99 is ambiguous)."""
    if isinstance(value, bool) or value is None:
        raise ValueError("objective is required: a fraction such as 0.99 or a percentage such as '99%'")
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        number = Decimal(text.rstrip("%").strip())
    except InvalidOperation:
        raise ValueError(f"objective {value!r} is neither a fraction (0.99) nor a percentage ('99%')") from None
    if not number.is_finite():
        raise ValueError(f"objective {value!r} is not a number")
    if percent:
        number = number / 100
    elif number >= 1:
        raise ValueError(f"objective {value!r} must be a fraction below 1 (0.99) or a percentage string ('99%')")
    if not 0 < number < 1:
        raise ValueError(f"objective must be above 0% and below 100%, not {value!r}")
    if number > Decimal("0.999999"):
        raise ValueError(f"objective {value!r} leaves an error budget below one request in a million; "
                         "at most 99.9999%")
    return float(number)


def format_objective(objective: float) -> str:
    text = f"{Decimal(repr(objective)) * 100:f}".rstrip("0").rstrip(".")
    return f"{text}%"


def parse_period(value) -> int:
    if isinstance(value, bool):
        raise ValueError("period must be 28d or 30d")
    if isinstance(value, int):
        days = value
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+\s*d\s*", value):
        days = int(value.strip().rstrip("d"))
    else:
        raise ValueError(f"period must be 28d or 30d, not {value!r}")
    if days not in PERIODS_DAYS:
        raise ValueError(f"period must be 28d or 30d, not {value!r}")
    return days


def parse_duration(value, field: str) -> dt.timedelta:
    if isinstance(value, int) and not isinstance(value, bool):
        return dt.timedelta(seconds=value)
    try:
        return burn.parse_window(value)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def validate(data, *, where: str = "") -> dict:
    """A definition (dict) → model field values. Raises DefinitionError listing every problem."""
    if not isinstance(data, dict):
        raise DefinitionError([f"an SLO definition is a mapping of fields, not {type(data).__name__}"], where)
    problems: list[str] = []
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(map(repr, unknown))}; known fields: {', '.join(FIELDS)}")
    out: dict = {}

    name = data.get("name")
    if not isinstance(name, str) or not _SLUG.match(name):
        problems.append(f"name: a slug of lowercase letters, digits, '-' and '_' (at most 100), not {name!r}")
    else:
        out["name"] = name
    where = where or (f"SLO {name!r}" if isinstance(name, str) else "")

    description = data.get("description", "")
    if not isinstance(description, str) or len(description) > 2000:
        problems.append("description: text of at most 2000 characters")
    else:
        out["description"] = description

    sli = data.get("sli")
    if sli not in Sli.values:
        problems.append(f"sli: one of {', '.join(Sli.values)}, not {sli!r}")
    else:
        out["sli"] = sli
    threshold = data.get("threshold_ms")
    if sli in LATENCY_SLIS:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
                or threshold <= 0:
            problems.append(f"threshold_ms: sli {sli} needs a latency threshold in milliseconds > 0, not {threshold!r}")
        elif threshold > 3_600_000:
            problems.append("threshold_ms: at most 3600000 (one hour)")
        else:
            out["threshold_ms"] = float(threshold)
    elif sli == Sli.ERROR_RATIO:
        if threshold is not None:
            problems.append("threshold_ms: error_ratio counts failed requests and takes no threshold; remove it")
        out["threshold_ms"] = None
    elif sli == Sli.ENGINE_MODEL_ERROR:
        if threshold is not None:
            problems.append("threshold_ms: engine_model_error's threshold is a ratio, not milliseconds: give "
                            "`threshold` (e.g. 0.2 for 20%) and remove threshold_ms")
        out["threshold_ms"] = None
    ratio = data.get("threshold")
    if sli == Sli.ENGINE_MODEL_ERROR:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) \
                or not 0 < ratio <= 1:
            problems.append(f"threshold: engine_model_error needs the largest |relative error| of a good check, "
                            f"a fraction above 0 and at most 1 (0.2 = 20%), not {ratio!r}")
        else:
            out["threshold"] = float(ratio)
    elif sli in Sli.values:
        if ratio is not None:
            problems.append("threshold: only engine_model_error takes a ratio threshold"
                            + ("; a latency SLI takes threshold_ms" if sli in LATENCY_SLIS else "; remove it"))
        out["threshold"] = None

    objective = None
    try:
        objective = parse_objective(data.get("objective"))
        out["objective"] = objective
    except ValueError as exc:
        problems.append(f"objective: {exc}")
    try:
        out["period_days"] = parse_period(data.get("period", "30d"))
    except ValueError as exc:
        problems.append(f"period: {exc}")

    filters = _filters(data.get("filters", {}) or {}, problems)
    if filters is not None and sli == Sli.ENGINE_MODEL_ERROR:
        others = [k for k in filters if k not in MODEL_CHECK_FILTERS]
        if others:
            problems.append(f"filters: engine_model_error counts live checks of a replica group's engine model, which "
                            f"only replica_group selects; remove {', '.join(others)}")
            filters = None
    if filters is not None:
        out["filters"] = filters

    include_cached = data.get("include_cached", False)
    if not isinstance(include_cached, bool):
        problems.append(f"include_cached: true (also count requests the gateway's response cache answered) or false "
                        f"(engine-served requests only), not {include_cached!r}")
    elif include_cached and sli == Sli.ENGINE_MODEL_ERROR:
        problems.append("include_cached: engine_model_error counts checks of the engine model, not requests; "
                        "remove it (or false)")
    else:
        out["include_cached"] = include_cached

    tiers = _tiers(data.get("tiers", "default"), problems)
    if tiers is not None:
        out["tiers"] = tiers
        if objective is not None and "period_days" in out:
            problems.extend(_tier_feasibility(tiers, objective, dt.timedelta(days=out["period_days"])))

    for field, default in (("min_requests", 20), ("min_bad", 3)):
        value = data.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10_000_000:
            problems.append(f"{field}: a whole number between 0 and 10000000, not {value!r}")
        else:
            out[field] = value

    no_data = data.get("no_data", NoDataPolicy.OK)
    if no_data not in NoDataPolicy.values:
        problems.append(f"no_data: one of {', '.join(NoDataPolicy.values)} (what to do when no request was seen "
                        f"in the fastest tier's long window), not {no_data!r}")
    else:
        out["no_data"] = no_data

    try:
        repeat = parse_duration(data.get("repeat_interval", "4h"), "repeat_interval")
        if not MIN_REPEAT <= repeat <= MAX_REPEAT:
            problems.append("repeat_interval: between 1m and 7d")
        else:
            out["repeat_interval_seconds"] = int(repeat.total_seconds())
    except ValueError as exc:
        problems.append(str(exc))

    labels = data.get("labels", {}) or {}
    if not isinstance(labels, dict):
        problems.append("labels: a mapping of label names to strings")
    else:
        bad = [k for k, v in labels.items() if not isinstance(k, str) or not _LABEL_NAME.match(k)
               or not isinstance(v, str) or len(v) > 200 or k in _RESERVED_LABELS]
        if bad or len(labels) > 20:
            problems.append(f"labels: at most 20, names like team or tier_owner (not {', '.join(sorted(_RESERVED_LABELS))}),"
                            f" string values of at most 200 characters; bad: {', '.join(map(repr, bad)) or 'too many'}")
        else:
            out["labels"] = dict(labels)

    enabled = data.get("enabled", True)
    if not isinstance(enabled, bool):
        problems.append(f"enabled: true or false, not {enabled!r}")
    else:
        out["enabled"] = enabled

    if problems:
        raise DefinitionError(problems, where)
    return out


def _filters(value, problems: list[str]) -> dict | None:
    if not isinstance(value, dict):
        problems.append(f"filters: a mapping with keys among {', '.join(FILTER_DIMENSIONS)}")
        return None
    out: dict[str, list[str]] = {}
    ok = True
    for key, raw in value.items():
        if key not in FILTER_DIMENSIONS:
            problems.append(f"filters: unknown key {key!r}; use {', '.join(FILTER_DIMENSIONS)}")
            ok = False
            continue
        values = [raw] if isinstance(raw, str) else raw
        if not isinstance(values, list) or not values or len(values) > MAX_FILTER_VALUES or not all(
                isinstance(v, str) and 0 < len(v) <= 256 for v in values):
            problems.append(f"filters.{key}: a non-empty string or a list of 1 to {MAX_FILTER_VALUES} non-empty strings")
            ok = False
            continue
        if key == "prompt_bucket":
            wrong = [v for v in values if v not in PROMPT_BUCKETS]
            if wrong:
                problems.append(f"filters.prompt_bucket: {', '.join(map(repr, wrong))} is not a bucket; "
                                f"buckets are {', '.join(PROMPT_BUCKETS)}")
                ok = False
                continue
        out[key] = sorted(set(values))
    return out if ok else None


def _tiers(value, problems: list[str]) -> list[dict] | None:
    """'default' (or absent) → [] (the SRE Workbook tiers); else a validated list of tier dicts."""
    if value in ("default", None):
        return []
    if not isinstance(value, list) or not value or len(value) > MAX_TIERS:
        problems.append(f"tiers: 'default' or a list of 1 to {MAX_TIERS} tiers "
                        "({name, severity: page|ticket, long_window, short_window, factor})")
        return None
    out = []
    names = set()
    ok = True
    for i, tier in enumerate(value):
        label = f"tiers[{i}]"
        if not isinstance(tier, dict):
            problems.append(f"{label}: a mapping with name, severity, long_window, short_window, factor")
            ok = False
            continue
        unknown = set(tier) - {"name", "severity", "long_window", "short_window", "factor"}
        if unknown:
            problems.append(f"{label}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
            ok = False
        name = tier.get("name")
        if not isinstance(name, str) or not _SLUG.match(name) or name == "no_data":
            problems.append(f"{label}.name: a slug such as page-1h, not {name!r}")
            ok = False
        elif name in names:
            problems.append(f"{label}.name: {name!r} is used twice")
            ok = False
        names.add(name)
        if tier.get("severity") not in burn.SEVERITIES:
            problems.append(f"{label}.severity: page or ticket, not {tier.get('severity')!r}")
            ok = False
        windows = {}
        for key in ("long_window", "short_window"):
            try:
                windows[key] = burn.parse_window(tier.get(key))
            except ValueError as exc:
                problems.append(f"{label}.{key}: {exc}")
                ok = False
        if len(windows) == 2 and windows["short_window"] >= windows["long_window"]:
            problems.append(f"{label}: short_window must be shorter than long_window "
                            "(it confirms the burn is still going on; typically 1/12 of it)")
            ok = False
        if any(w > dt.timedelta(days=30) for w in windows.values()):
            problems.append(f"{label}: windows of at most 30d")
            ok = False
        factor = tier.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            problems.append(f"{label}.factor: a burn rate > 0 (e.g. 14.4), not {factor!r}")
            ok = False
        if ok:
            out.append({
                "name": name, "severity": tier["severity"],
                "long_window": burn.window_label(windows["long_window"]),
                "short_window": burn.window_label(windows["short_window"]),
                "factor": float(factor),
            })
    if ok and out == [t.as_dict() for t in burn.DEFAULT_TIERS]:
        return []  # the defaults written out are the defaults: they follow the platform's
    return out if ok else None


def _tier_feasibility(tiers: list[dict], objective: float, period: dt.timedelta) -> list[str]:
    """The tiers that can never fire for this objective: a burn of f needs f × (1 − objective) of the
    requests to be bad, impossible above 100%."""
    problems = []
    resolved = _as_burn_tiers(tiers)
    for tier in resolved:
        if tier.long_window > period:
            problems.append(f"tiers: {tier.name} has a long window ({burn.window_label(tier.long_window)}) longer than "
                            f"the period ({period.days}d)")
        if burn.can_fire(tier, objective):
            continue
        budget = burn.error_budget(objective)
        needed = tier.factor * budget
        lowest = 1 - 1 / tier.factor
        defaults = "the default tiers include it: list your own `tiers:` without it" if not tiers else \
            "drop this tier"
        problems.append(
            f"tiers: objective {format_objective(objective)} leaves an error budget of {format_objective(budget)}, "
            f"so tier {tier.name} ({tier.factor:g}× over {burn.window_label(tier.long_window)}, "
            f"{tier.budget_share(period):.1%} of the {period.days}-day budget) can never fire: it needs "
            f"{tier.factor:g} × {format_objective(budget)} = {needed:.0%} of requests to be bad, and at most 100% can be. "
            f"{defaults[0].upper() + defaults[1:]}, lower its factor to at most {1 / budget:.4g}, or raise the "
            f"objective above {format_objective(round(lowest, 6))}"
        )
    return problems


def _as_burn_tiers(tiers: list[dict]) -> tuple[burn.BurnTier, ...]:
    if not tiers:
        return burn.DEFAULT_TIERS
    return tuple(burn.BurnTier(t["name"], t["severity"], burn.parse_window(t["long_window"]),
                               burn.parse_window(t["short_window"]), t["factor"]) for t in tiers)


def render(slo: SLO) -> dict:
    """An SLO as a definition (the YAML/API form): validate(render(slo)) gives back the same fields."""
    data = {
        "name": slo.name,
        "description": slo.description,
        "sli": slo.sli,
        **({"threshold_ms": slo.threshold_ms} if slo.sli in LATENCY_SLIS else {}),
        **({"threshold": slo.threshold} if slo.sli == Sli.ENGINE_MODEL_ERROR else {}),
        "objective": format_objective(slo.objective),
        "period": f"{slo.period_days}d",
        "filters": dict(slo.filters or {}),
        "include_cached": slo.include_cached,
        "tiers": list(slo.tiers) if slo.tiers else "default",
        "min_requests": slo.min_requests,
        "min_bad": slo.min_bad,
        "no_data": slo.no_data,
        "repeat_interval": burn.window_label(dt.timedelta(seconds=slo.repeat_interval_seconds))
        if slo.repeat_interval_seconds % 60 == 0 else slo.repeat_interval_seconds,
        "labels": dict(slo.labels or {}),
        "enabled": slo.enabled,
    }
    return data


def changes(slo: SLO, fields: dict) -> dict[str, tuple]:
    """Field → (old, new) for the fields that differ."""
    out = {}
    for key, new in fields.items():
        old = getattr(slo, key)
        if old != new:
            out[key] = (old, new)
    return out
