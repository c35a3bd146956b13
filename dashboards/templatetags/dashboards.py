"""Formatting for the dashboard's templates. Everything returned is plain text: the templates escape it."""
from __future__ import annotations

from django import template

register = template.Library()

LABELS = {"model": "model", "service": "service", "engine_config": "engine config", "replica_group": "replica group",
          "prompt_bucket": "prompt length", "gateway": "gateway"}


@register.filter
def ms(value) -> str:
    """A duration in milliseconds, to a sensible precision; '–' when not observed."""
    if value is None:
        return "–"
    value = float(value)
    if abs(value) >= 10_000:
        return f"{value / 1000:.1f} s"
    if abs(value) >= 100:
        return f"{value:.0f} ms"
    if abs(value) >= 1:
        return f"{value:.1f} ms"
    return f"{value:.2f} ms"


@register.filter
def percent(value) -> str:
    return "–" if value is None else f"{100.0 * float(value):.2f}%"


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
    if value is None:
        return "–"
    return ("+" if float(value) >= 0 else "−") + ms(abs(float(value)))


@register.filter
def num(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
