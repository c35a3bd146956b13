"""Rollouts: one replica group's engine config changed through a plan of steps (regression gate, canary weights
judged on request-level latency, approval, promotion), or rolled back with the reason.

The rollout row is the state machine (advanced by ``rollouts.advance`` on the beat schedule; every change is a
conditional UPDATE on ``revision``, so two workers never both make the same transition); every transition writes
a RolloutTransition row (who, when, why, the analysis figures) in the same database transaction; each analysis
of a canary step is kept as a RolloutAnalysis row (the page's charts and verdicts).
"""
from django.db import models
from django.db.models import Q
from django.utils import timezone


class RolloutState(models.TextChoices):
    PENDING = "pending"
    GATING = "gating"
    PROGRESSING = "progressing"
    PAUSED = "paused"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"
    FAILED = "failed"


ACTIVE_STATES = (RolloutState.PENDING, RolloutState.GATING, RolloutState.PROGRESSING, RolloutState.PAUSED)
FINAL_STATES = (RolloutState.PROMOTED, RolloutState.ROLLED_BACK, RolloutState.ABORTED, RolloutState.FAILED)


class Rollout(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="rollouts")
    group = models.CharField(max_length=64)
    canary_group = models.CharField(max_length=64)
    config = models.JSONField()  # the new engine config (vLLM knob names)
    baseline_config = models.JSONField()  # the group's config when the rollout started (restored on rollback)
    baseline_weights = models.JSONField(default=dict)  # every group's gateway weight when it started
    config_version = models.CharField(max_length=32)
    source = models.CharField(max_length=64, blank=True, default="")  # "file", "api", "study:12"
    study = models.ForeignKey("tuning.TuningStudy", null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="rollouts")
    plan = models.JSONField()  # rollouts.plan.parse_plan(...): {"steps": [...], "analysis": {...}, ...}
    state = models.CharField(max_length=16, choices=RolloutState.choices, default=RolloutState.PENDING)
    # Index into plan["steps"] of the step under way (== len(steps) once every step is done).
    step = models.PositiveIntegerField(default=0)
    step_started_at = models.DateTimeField(null=True, blank=True)
    step_extensions = models.PositiveIntegerField(default=0)
    # What the step has done so far (e.g. {"canary": "started", "weights": {...}}) and its gate run.
    step_status = models.JSONField(default=dict)
    gate_run = models.ForeignKey("regressions.RegressionRun", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="+")
    paused_from = models.CharField(max_length=16, blank=True, default="")
    approved = models.BooleanField(default=False)  # the approval step under way was approved
    reason = models.TextField(blank=True, default="")
    revision = models.PositiveIntegerField(default=0)  # bumped by every change; conditional updates check it
    ticking_until = models.DateTimeField(null=True, blank=True)  # a worker is advancing it until then
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    @property
    def twin_group(self) -> str | None:
        """The baseline twin's group (the group's config on as many replicas as the canary's, given as much
        traffic) when the plan compares with one; None when the canary is compared with the group itself."""
        if (self.plan or {}).get("compare_with") != "twin" or not self.canary_group:
            return None
        return f"{self.group[:40]}-baseline-{self.id}"

    @property
    def baseline_group(self) -> str:
        """The group whose requests the canary's are compared with."""
        return self.twin_group or self.group

    @property
    def canary_weight(self) -> float:
        """The canary's share (%) of the group's traffic the step asks for (0 outside canary steps): a canary
        step's weight once the canary takes it, the previous canary step's before that and after it."""
        if self.state not in (RolloutState.PROGRESSING, RolloutState.PAUSED, RolloutState.GATING):
            return 0.0
        steps = self.plan["steps"]
        if self.step < len(steps) and steps[self.step]["kind"] == "canary" and \
                (self.step_status or {}).get("traffic_since"):
            return steps[self.step]["weight"]
        return self.previous_canary_weight or 0.0

    @property
    def previous_canary_weight(self) -> float | None:
        """The weight of the last canary step before the one under way; None when there was none."""
        weights = [s["weight"] for s in self.plan["steps"][:self.step] if s["kind"] == "canary"]
        return weights[-1] if weights else None

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["project", "-created_at"]), models.Index(fields=["state"])]
        constraints = [
            # One rollout per group at a time, whatever the race between two admins.
            models.UniqueConstraint(fields=["project", "group"], condition=Q(state__in=ACTIVE_STATES),
                                    name="rollouts_one_active_per_group"),
        ]

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def __str__(self) -> str:
        return f"rollout {self.id} ({self.group})"


class RolloutTransition(models.Model):
    """The audit: every state or step change, by whom (a user, or "system"), why, and the figures behind it."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="transitions")
    at = models.DateTimeField(default=timezone.now)
    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16)
    to_state = models.CharField(max_length=16)
    step = models.PositiveIntegerField()
    revision = models.PositiveIntegerField()  # the rollout's revision this transition produced
    reason = models.TextField(blank=True, default="")
    figures = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]
        constraints = [models.UniqueConstraint(fields=["rollout", "revision"], name="rollouts_transition_once")]


class RolloutAnalysis(models.Model):
    """One look at a canary step: canary against baseline over the step's requests so far."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="analyses")
    step = models.PositiveIntegerField()
    at = models.DateTimeField(default=timezone.now)
    since = models.DateTimeField()
    until = models.DateTimeField()
    verdict = models.CharField(max_length=16)  # pass, fail, inconclusive, pending (too early to judge)
    final = models.BooleanField(default=False)  # the look that ended the step (or its extension)
    summary = models.TextField(blank=True, default="")
    figures = models.JSONField(default=dict)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["rollout", "step", "at"])]
