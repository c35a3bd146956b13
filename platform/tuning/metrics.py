"""Prometheus series of engine models (tuning.calibration), served on /metrics to an API token for its projects
(observatory.views.prometheus_metrics), like the SLO and rollout series: they name projects and groups.

``observatory_engine_model_error_ratio{project, group, figure, quantile, slice}``: (predicted − observed) /
observed of the group's newest model, per figure (ttft_ms, tpot_ms, queue_ms) and quantile (p50, p95), on the
held-out slice of its calibration window (``slice="held_out"``) and on the latest traffic (``slice="live"``,
refreshed by the worker every TUNING_CALIBRATION_CHECK_SECONDS). A live error that rises is the group drifting from
what the model learned (a driver update, a noisy neighbour, a degraded GPU).

``observatory_engine_model_cost_change_ratio{project, group, cost}``: which cost moved, on the same latest traffic:
observed against the model's replay at the same batch sizes, minus one, for ``cost="decode"`` (the mean TPOT: the
decode step's time) and ``cost="prefill"`` (the engine's TTFT less its queue). An alert rule on it names the cost:
``observatory_engine_model_cost_change_ratio{cost="decode"} > 0.2``."""
from __future__ import annotations

import logging

from prometheus_client.core import GaugeMetricFamily

from .models import EngineModel, ModelState

log = logging.getLogger(__name__)
NAME = "observatory_engine_model_error_ratio"
LABELS = ["project", "group", "figure", "quantile", "slice"]
COST_NAME = "observatory_engine_model_cost_change_ratio"
COST_LABELS = ["project", "group", "cost"]


class EngineModelCollector:
    def __init__(self, project_ids):
        self.project_ids = list(project_ids)

    def describe(self):
        return [GaugeMetricFamily(NAME, "", labels=LABELS), GaugeMetricFamily(COST_NAME, "", labels=COST_LABELS)]

    def collect(self):
        try:
            models = list(EngineModel.objects.filter(project_id__in=self.project_ids, state=ModelState.FITTED)
                          .select_related("project").order_by("project__name", "group", "-created_at", "-id"))
        except Exception:  # no database: the rest of /metrics still works
            log.warning("engine model metrics unavailable", exc_info=True)
            return
        family = GaugeMetricFamily(NAME, "Relative error of each group's newest engine model: predicted against "
                                   "observed, on its held-out slice and on the latest traffic", labels=LABELS)
        costs = GaugeMetricFamily(COST_NAME, "Each cost of each group's newest engine model on the latest traffic: "
                                  "observed against the model's replay at the same batch sizes, minus one",
                                  labels=COST_LABELS)
        seen = set()
        for model in models:
            if (model.project_id, model.group) in seen:
                continue
            seen.add((model.project_id, model.group))
            for slice_name, errors in (("held_out", model.held_out_error), ("live", model.live_error)):
                for key, value in sorted((errors or {}).items()):
                    figure, _, quantile = key.rpartition("_")
                    family.add_metric([model.project.name, model.group, figure, quantile, slice_name], value)
            for cost, value in sorted((model.live_moved or {}).items()):
                costs.add_metric([model.project.name, model.group, cost], value)
        yield family
        yield costs
