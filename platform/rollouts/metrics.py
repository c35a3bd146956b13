"""Prometheus series of rollouts.

- ``observatory_rollout_transitions_total{action, to_state}``: transitions this process made (open, no project).
- Per rollout, read from the database at scrape time, served like the per-SLO series only to an API token for its
  projects (they name projects and groups): ``observatory_rollout_state{project, group, rollout, state}`` (1 for
  the rollout's state; active rollouts and those finished in the last hour), ``observatory_rollout_step``,
  ``observatory_rollout_canary_weight_percent``.
"""
from __future__ import annotations

import datetime as dt
import logging

from django.db.models import Q
from django.utils import timezone
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from .models import ACTIVE_STATES, Rollout

log = logging.getLogger(__name__)

TRANSITIONS = Counter("observatory_rollout_transitions", "Rollout transitions made by this process",
                      ["action", "to_state"])


class RolloutCollector:
    def __init__(self, project_ids):
        self.project_ids = list(project_ids)

    def describe(self):
        return []

    def collect(self):
        if not self.project_ids:
            return
        try:
            recent = timezone.now() - dt.timedelta(hours=1)
            rollouts = list(Rollout.objects.filter(project_id__in=self.project_ids)
                            .filter(Q(state__in=ACTIVE_STATES) | Q(finished_at__gte=recent))
                            .select_related("project").order_by("id"))
        except Exception:
            log.warning("rollout metrics unavailable", exc_info=True)
            return
        state = GaugeMetricFamily("observatory_rollout_state", "1 for the rollout's state (active rollouts and those "
                                  "finished in the last hour)", labels=["project", "group", "rollout", "state"])
        step = GaugeMetricFamily("observatory_rollout_step", "Index (from 0) of the rollout's step under way",
                                 labels=["project", "group", "rollout"])
        weight = GaugeMetricFamily("observatory_rollout_canary_weight_percent",
                                   "The canary's share of its group's traffic the step asks for (percent)",
                                   labels=["project", "group", "rollout"])
        for rollout in rollouts:
            labels = [rollout.project.name, rollout.group, str(rollout.id)]
            state.add_metric([*labels, rollout.state], 1)
            step.add_metric(labels, rollout.step)
            weight.add_metric(labels, rollout.canary_weight)
        yield state
        yield step
        yield weight
