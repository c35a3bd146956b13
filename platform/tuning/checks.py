"""Each live check of an engine model kept as an event of the SLI `engine_model_error`: calibration.refresh_live_error
hands every measurement here, and it becomes one row of ClickHouse's `engine_model_checks` (the slo app's SQL writes
and counts it), so an SLO can count, over its windows, the checks whose worst error passed its threshold. A check is
judged on what a study's bound and the drift alert judge on the latest traffic (calibration.LIVE_GATED: p50 prefill
time and p50 TPOT); its p50 TTFT error is kept beside them, for reading."""
from __future__ import annotations

import datetime as dt
import logging
import math

from slo import queries as slo_queries
from traces.store import get_store

from .models import EngineModel

log = logging.getLogger(__name__)

TTFT, PREFILL, TPOT = "ttft_ms_p50", "prefill_ms_p50", "tpot_ms_p50"


def _figure(errors: dict[str, float] | None, name: str) -> float | None:
    value = (errors or {}).get(name)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def record(model: EngineModel, errors: dict[str, float], worst_error: float | None, moved: dict[str, float],
           requests: int, at: dt.datetime) -> bool:
    """Write the check of ``model`` at ``at``, judged on ``worst_error`` (calibration.live_worst of ``errors``); False
    when there is nothing to write (no judged figure) or the store refused it. A lost check is one event the SLO does
    not count: it is logged, and never stops the measurement's other effects (the model's live figures, the drift
    alert)."""
    if worst_error is None or not math.isfinite(worst_error):
        return False
    check = {
        "at": at, "group": model.group, "model_id": model.id, "config_version": model.config_version,
        "worst_error": float(worst_error), "ttft_p50_error": _figure(errors, TTFT),
        "prefill_p50_error": _figure(errors, PREFILL), "tpot_p50_error": _figure(errors, TPOT),
        "requests": requests,
        "moved": {cost: float(v) for cost, v in (moved or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)},
    }
    try:
        slo_queries.insert_model_check(get_store(), model.project_id, check)
    except Exception:  # noqa: BLE001 - see the docstring: the check is lost, the rest of the measurement stands
        log.exception("engine model %s: live check of %s/%s not recorded", model.id, model.project_id, model.group)
        return False
    return True
