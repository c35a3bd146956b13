"""A loop policy, parsed from the API or a file, every problem reported at once (``PolicyError.problems``).

    {"group": "chat",                      # empty or absent: the project's policy (a group's overrides it)
     "mode": "auto",                       # off | propose | approve | auto
     "knobs": {"max_num_seqs": {"max_factor": 2}, "max_num_batched_tokens": {"max_factor": 2},
               "enable_chunked_prefill": {}},
     "cooldown": "6h",                     # one loop per group per cooldown (seconds or 30m/6h/1d)
     "freeze": [{"start": "2026-12-24T00:00:00Z", "end": "2026-12-27T00:00:00Z", "reason": "holidays"},
                {"days": ["sat", "sun"], "from": "00:00", "to": "24:00"}],   # UTC
     "min_confidence": {"model_error": 0.2, "confirmation": true},
     "plan": {...},                        # the rollouts' plan (docs/rollouts.md); a gate is required when the
                                           # project has a golden dataset
     "study": {"trials": 30, "window_hours": 1},
     "watch": "1h", "approval_expires": "1h"}

Knobs are vLLM's (tuning.space.KNOBS). A numeric knob may move by at most ``max_factor`` either way from what the
group runs (default 2); a knob left out is never changed. ``auto`` needs a cooldown: a loop that may change a
group again at once would chase its own canary.
"""
from __future__ import annotations

import datetime as dt
import re
from typing import Any

from apikit.inputs import parse_duration
from rollouts.plan import PlanError, parse_plan
from tuning.space import BOOL_KNOBS, DEFAULT_SPACE, FLOAT_KNOBS, KNOBS

from .models import Mode

FIELDS = ("group", "mode", "knobs", "cooldown", "freeze", "min_confidence", "plan", "study", "watch",
          "approval_expires")
DEFAULTS: dict[str, Any] = {
    "mode": Mode.OFF, "knobs": {"max_num_seqs": {"max_factor": 2}, "max_num_batched_tokens": {"max_factor": 2}},
    "cooldown_seconds": 6 * 3600, "freeze": [], "min_confidence": {"model_error": 0.2, "confirmation": True},
    "study": {"trials": 30, "window_hours": 1.0}, "watch_seconds": 3600, "approval_seconds": 3600,
}
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
MAX_FACTOR = 16.0
TEXT_KNOBS = frozenset({"kv_cache_dtype", "scheduling_policy", "speculative_method"})
_HHMM = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$|^24:00$")


class PolicyError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def _seconds(value: Any, name: str, problems: list[str], *, low: float, high: float) -> int | None:
    if isinstance(value, bool):
        problems.append(f"{name}: seconds or a duration such as 30m, 6h, 1d, not {value!r}")
        return None
    if isinstance(value, str):
        try:
            value = parse_duration(value, minimum=dt.timedelta(seconds=low),
                                   maximum=dt.timedelta(seconds=high)).total_seconds()
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            return None
    if not isinstance(value, (int, float)) or not low <= value <= high:
        problems.append(f"{name}: between {low:g} and {high:g} seconds, not {value!r}")
        return None
    return int(value)


def _knobs(value: Any, problems: list[str]) -> dict[str, dict]:
    if not isinstance(value, dict) or not value:
        problems.append("knobs: a mapping of the vLLM knobs the loop may change to their limits, e.g. "
                        '{"max_num_seqs": {"max_factor": 2}}')
        return {}
    out = {}
    for knob, limit in value.items():
        if knob not in KNOBS:
            problems.append(f"knobs: {knob!r} is not a knob the engine has (known: {', '.join(KNOBS)})")
            continue
        limit = {} if limit is None else limit
        if not isinstance(limit, dict) or set(limit) - {"max_factor"}:
            problems.append(f"knobs.{knob}: {{}} or {{\"max_factor\": N}}, not {limit!r}")
            continue
        numeric = knob not in BOOL_KNOBS and knob not in TEXT_KNOBS
        if "max_factor" in limit:
            factor = limit["max_factor"]
            if not numeric:
                problems.append(f"knobs.{knob}: max_factor applies to numeric knobs only")
                continue
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 < factor <= MAX_FACTOR:
                problems.append(f"knobs.{knob}.max_factor: a number in (1, {MAX_FACTOR:g}], not {factor!r}")
                continue
            out[knob] = {"max_factor": float(factor)}
        else:
            out[knob] = {"max_factor": 2.0} if numeric and knob not in FLOAT_KNOBS else {}
    return out


def _freeze(value: Any, problems: list[str]) -> list[dict]:
    if not isinstance(value, list):
        problems.append("freeze: a list of windows")
        return []
    out = []
    for i, window in enumerate(value):
        where = f"freeze[{i}]"
        if not isinstance(window, dict):
            problems.append(f"{where}: an object")
            continue
        reason = window.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 200:
            problems.append(f"{where}.reason: text of at most 200 characters")
            continue
        if "start" in window or "end" in window:
            if set(window) - {"start", "end", "reason"}:
                problems.append(f"{where}: start, end and reason only")
                continue
            try:
                start, end = (_utc(window.get(k)) for k in ("start", "end"))
            except (TypeError, ValueError):
                problems.append(f"{where}: start and end are ISO 8601 times (UTC when no offset is given)")
                continue
            if end <= start:
                problems.append(f"{where}: end must be after start")
                continue
            out.append({"start": start.isoformat(), "end": end.isoformat(), "reason": reason})
        else:
            if set(window) - {"days", "from", "to", "reason"}:
                problems.append(f"{where}: start/end (a one-off window) or days/from/to (a weekly one), and reason")
                continue
            days = window.get("days")
            if not isinstance(days, list) or not days or any(d not in DAYS for d in days):
                problems.append(f"{where}.days: a non-empty list of {', '.join(DAYS)}")
                continue
            start, end = window.get("from", "00:00"), window.get("to", "24:00")
            if not (isinstance(start, str) and _HHMM.match(start) and isinstance(end, str) and _HHMM.match(end)) \
                    or end <= start:
                problems.append(f"{where}: from and to are HH:MM (UTC), from before to")
                continue
            out.append({"days": sorted(set(days), key=DAYS.index), "from": start, "to": end, "reason": reason})
    return out


def _utc(text: Any) -> dt.datetime:
    if not isinstance(text, str):
        raise TypeError(text)
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def _confidence(value: Any, problems: list[str]) -> dict:
    if not isinstance(value, dict) or set(value) - {"model_error", "confirmation"}:
        problems.append('min_confidence: {"model_error": 0.2, "confirmation": true}')
        return {}
    out = dict(DEFAULTS["min_confidence"])
    if "model_error" in value:
        bound = value["model_error"]
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound <= 1:
            problems.append(f"min_confidence.model_error: the engine model's largest error allowed, in (0, 1], not "
                            f"{bound!r}")
        else:
            out["model_error"] = float(bound)
    if "confirmation" in value:
        if not isinstance(value["confirmation"], bool):
            problems.append("min_confidence.confirmation: true (the winner must be confirmed on replicas) or false")
        else:
            out["confirmation"] = value["confirmation"]
    return out


def _study(value: Any, problems: list[str]) -> dict:
    if not isinstance(value, dict) or set(value) - {"trials", "window_hours"}:
        problems.append('study: {"trials": 30, "window_hours": 1}')
        return {}
    out = dict(DEFAULTS["study"])
    trials = value.get("trials", out["trials"])
    if isinstance(trials, bool) or not isinstance(trials, int) or not 1 <= trials <= 500:
        problems.append(f"study.trials: an integer in 1..500, not {trials!r}")
    else:
        out["trials"] = trials
    hours = value.get("window_hours", out["window_hours"])
    if isinstance(hours, bool) or not isinstance(hours, (int, float)) or not 0 < hours <= 24:
        problems.append(f"study.window_hours: the recent traffic the study replays, in (0, 24] hours, not {hours!r}")
    else:
        out["window_hours"] = float(hours)
    return out


def parse_policy(data: Any, *, default_dataset: str | None) -> dict[str, Any]:
    """The policy's stored fields (mode, knobs, cooldown_seconds, ...) from ``data``; PolicyError lists every
    problem. ``default_dataset``: the project's golden dataset, when it has one (the plan then needs a gate)."""
    if not isinstance(data, dict):
        raise PolicyError(["a loop policy is a JSON object"])
    problems = [f"{key}: not a field of a loop policy (fields: {', '.join(FIELDS)})" for key in data
                if key not in FIELDS]
    out: dict[str, Any] = {k: (v.copy() if isinstance(v, (dict, list)) else v) for k, v in DEFAULTS.items()}
    group = data.get("group") or ""
    if not isinstance(group, str) or len(group) > 100:
        problems.append("group: a replica group's name, or empty for the project's policy")
    out["group"] = group if isinstance(group, str) else ""
    mode = data.get("mode", Mode.OFF)
    if mode not in Mode.values:
        problems.append(f"mode: one of {', '.join(Mode.values)}, not {mode!r}")
    out["mode"] = mode
    if "knobs" in data:
        out["knobs"] = _knobs(data["knobs"], problems)
    if "cooldown" in data:
        out["cooldown_seconds"] = _seconds(data["cooldown"], "cooldown", problems, low=0, high=30 * 86400)
    if mode == Mode.AUTO and out["cooldown_seconds"] == 0:
        problems.append("cooldown: auto needs a cooldown above 0 (one loop per group per cooldown): a loop that may "
                        "change a group again at once would chase its own canary")
    if "freeze" in data:
        out["freeze"] = _freeze(data["freeze"], problems)
    if "min_confidence" in data:
        out["min_confidence"] = _confidence(data["min_confidence"], problems)
    if "study" in data:
        out["study"] = _study(data["study"], problems)
    if "watch" in data:
        out["watch_seconds"] = _seconds(data["watch"], "watch", problems, low=60, high=7 * 86400)
    if "approval_expires" in data:
        out["approval_seconds"] = _seconds(data["approval_expires"], "approval_expires", problems, low=60,
                                           high=7 * 86400)
    try:
        out["plan"] = parse_plan(data.get("plan"), default_dataset=default_dataset)
    except PlanError as exc:
        problems += [f"plan: {p}" for p in exc.problems]
        out["plan"] = {}
    if out["plan"] and default_dataset and not any(s["kind"] == "gate" for s in out["plan"]["steps"]):
        problems.append(f"plan: the project has a golden dataset ({default_dataset}): the loop's rollouts need a "
                        "regression gate step")
    if problems:
        raise PolicyError(problems)
    return out


def frozen(freeze: list[dict], at: dt.datetime) -> dict | None:
    """The freeze window ``at`` falls in, or None."""
    utc = at.astimezone(dt.timezone.utc)
    for window in freeze:
        if "start" in window:
            if _utc(window["start"]) <= utc < _utc(window["end"]):
                return window
        elif DAYS[utc.weekday()] in window["days"] and window["from"] <= utc.strftime("%H:%M") < window["to"]:
            return window
    return None


def space_for(knobs: dict[str, dict], current: dict[str, Any]) -> dict[str, Any]:
    """The study's search space: each allowed knob within its factor of the group's value (the default space's
    choices for the others); knobs left out are not searched."""
    space: dict[str, Any] = {}
    for knob, limit in knobs.items():
        value = current.get(knob)
        factor = limit.get("max_factor")
        if factor and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            if knob in FLOAT_KNOBS:
                space[knob] = {"low": value / factor, "high": min(value * factor, 0.99)}
            else:
                low, high = max(1, int(round(value / factor))), int(round(value * factor))
                space[knob] = {"low": low, "high": max(high, low + 1), "log": True}
        elif knob in DEFAULT_SPACE:
            space[knob] = DEFAULT_SPACE[knob]
    return space
