"""Each live check of an engine model kept as an event of the SLI `engine_model_error`: calibration.refresh_live_error
hands every measurement here, and it becomes one row of ClickHouse's `engine_model_checks` (the slo app's SQL writes
and counts it), so an SLO can count, over its windows, the checks whose worst p50 error passed its threshold."""
from __future__ import annotations

import datetime as dt
import logging
import math

from slo import queries as slo_queries
from traces.store import get_store

from .models import EngineModel

log = logging.getLogger(__name__)

# The figures a check is judged on, as a study's bound is (calibration.GATED): p50 TTFT and p50 TPOT.
TTFT, TPOT = "ttft_ms_p50", "tpot_ms_p50"


def worst(errors: dict[str, float] | None) -> float | None:
    """The larger |error| of p50 TTFT and TPOT; None when neither was measured."""
    values = [abs(v) for v in (_figure(errors, TTFT), _figure(errors, TPOT)) if v is not None]
    return max(values) if values else None


def _figure(errors: dict[str, float] | None, name: str) -> float | None:
    value = (errors or {}).get(name)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def record(model: EngineModel, errors: dict[str, float], moved: dict[str, float], requests: int,
           at: dt.datetime) -> bool:
    """Write the check of ``model`` at ``at``; False when there is nothing to write (no p50 figure) or the store
    refused it. A lost check is one event the SLO does not count: it is logged, and never stops the measurement's
    other effects (the model's live figures, the drift alert)."""
    worst_error = worst(errors)
    if worst_error is None:
        return False
    check = {
        "at": at, "group": model.group, "model_id": model.id, "config_version": model.config_version,
        "worst_error": worst_error, "ttft_p50_error": _figure(errors, TTFT), "tpot_p50_error": _figure(errors, TPOT),
        "requests": requests,
        "moved": {cost: float(v) for cost, v in (moved or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)},
    }
    try:
        slo_queries.insert_model_check(get_store(), model.project_id, check)
    except Exception:  # noqa: BLE001 - see the docstring: the check is lost, the rest of the measurement stands
        log.exception("engine model %s: live check of %s/%s not recorded", model.id, model.project_id, model.group)
        return False
    return True
