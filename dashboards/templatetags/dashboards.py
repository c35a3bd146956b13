"""Formatting for the dashboard's templates. Everything returned is plain text: the templates escape it."""
from __future__ import annotations

import datetime as dt
import json

from django import template

register = template.Library()

LABELS = {"model": "model", "service": "service", "engine_config": "engine config", "replica_group": "replica group",
          "prompt_bucket": "prompt length", "gateway": "gateway"}


def _number(value) -> float | None:
    """A figure as a float; None when it is missing (None, or '' for a key a template looked up in vain) or not a
    number."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@register.filter
def ms(value) -> str:
    """A duration in milliseconds, to a sensible precision; '–' when not observed."""
    value = _number(value)
    if value is None:
        return "–"
    if abs(value) >= 10_000:
        return f"{value / 1000:.1f} s"
    if abs(value) >= 100:
        return f"{value:.0f} ms"
    if abs(value) >= 1:
        return f"{value:.1f} ms"
    return f"{value:.2f} ms"


@register.filter
def percent(value) -> str:
    value = _number(value)
    return "–" if value is None else f"{100.0 * value:.2f}%"


@register.filter
def signed_percent(value) -> str:
    """A relative change or error (0.12) as "+12 %"; '–' when not measured."""
    value = _number(value)
    return "–" if value is None else f"{100.0 * value:+.0f} %".replace("-", "−")


@register.filter
def share_of(part, whole) -> str:
    """part / whole as a percentage ('–' when either is missing or whole is not positive)."""
    part, whole = _number(part), _number(whole)
    if part is None or whole is None or whole <= 0:
        return "–"
    return f"{100.0 * part / whole:.0f}%"


SERVED_FROM = {"engine": "engine", "exact_cache": "exact cache", "semantic_cache": "semantic cache"}


@register.filter
def served(value) -> str:
    """What answered a request (a row's served_from) in words; '–' when unknown."""
    return SERVED_FROM.get(value, value) if value else "–"


@register.filter
def duration_s(value) -> str:
    value = int(value)
    if value % 3600 == 0:
        return f"{value // 3600} h"
    if value % 60 == 0:
        return f"{value // 60} min"
    return f"{value} s"


@register.filter
def label(name: str) -> str:
    return LABELS.get(name, name.replace("_", " "))


@register.filter
def lookup(mapping, key):
    return mapping.get(key) if isinstance(mapping, dict) else None


@register.filter
def get(mapping, key):
    """mapping[key], or None (templates cannot index with a variable)."""
    return mapping.get(key) if isinstance(mapping, dict) else None


@register.filter
def can(viewer, role: str) -> bool:
    return viewer.can(role)


@register.filter
def burn(value) -> str:
    return "–" if value is None else f"{float(value):.2f}×"


@register.filter
def split(value: str):
    return value.split()


@register.filter
def signed_ms(value) -> str:
    value = _number(value)
    if value is None:
        return "–"
    return ("+" if value >= 0 else "−") + ms(abs(value))


@register.filter
def num(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


@register.filter
def pvalue(value) -> str:
    """A p-value: two significant digits, scientific below 1e-4."""
    value = _number(value)
    if value is None:
        return "–"
    return f"{value:.2g}" if value >= 1e-4 else f"{value:.1e}"


@register.filter
def points(value) -> str:
    """A rate already in percent (pass rate, error rate)."""
    return "–" if value is None else f"{float(value):.1f}%"


@register.filter
def interval_ms(value) -> str:
    if not value:
        return "–"
    return f"[{signed_ms(value[0])}, {signed_ms(value[1])}]"


@register.filter
def isotime(value) -> str:
    """An ISO 8601 time as 'YYYY-MM-DD HH:MM:SS' (UTC)."""
    if not value:
        return "–"
    return str(value)[:19].replace("T", " ")


@register.filter
def pretty_json(value) -> str:
    """Indented JSON of a config or document (for a <pre>)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str)


SLO_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "end-to-end", "queue_ms": "queue time"}


@register.filter
def slo_name(metric: str) -> str:
    """ttft_ms → TTFT, for SLO thresholds in sentences."""
    return SLO_NAMES.get(metric, metric)


@register.filter
def epoch_time(value) -> str:
    """An epoch (seconds) as HH:MM:SS UTC."""
    try:
        return dt.datetime.fromtimestamp(float(value), dt.timezone.utc).strftime("%H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):
        return "–"
