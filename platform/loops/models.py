"""A project's loop policies (per project, and per replica group where it differs) and the loops they allow: one
row per loop, its steps (the audit: who or what decided, why, with the figures) beside it."""
from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone


class Mode(models.TextChoices):
    OFF = "off", "off: a page starts nothing"
    PROPOSE = "propose", "propose: the loop stops at the study's proposal"
    APPROVE = "approve", "approve: the rollout waits for an admin's approval"
    AUTO = "auto", "auto: the rollout starts on its own"


class LoopState(models.TextChoices):
    STUDYING = "studying"  # a tuning study on the group's recent traffic, against the burning SLO
    AWAITING_APPROVAL = "awaiting_approval"  # the proposal waits for an admin (mode approve)
    ROLLING_OUT = "rolling_out"  # a rollout with the policy's plan
    WATCHING = "watching"  # promoted: the SLO's burn is watched for the policy's watch period
    PROPOSED = "proposed"  # final (mode propose): the proposal is the result
    RESTORED = "restored"  # final: promoted, and the SLO's burn rate fell below 1 within the watch
    NOT_RESTORED = "not_restored"  # final: promoted, but the SLO still burned at the watch's end
    ROLLED_BACK = "rolled_back"  # final: the rollout did not promote (rolled back, aborted, failed)
    DENIED = "denied"  # final: an admin denied the rollout
    EXPIRED = "expired"  # final: nobody approved in time
    ABORTED = "aborted"  # final: a page from the canary (the rollout was rolled back)
    FAILED = "failed"  # final: a step could not be done (its reason)
    ENDED = "ended"  # final: a human ended it


ACTIVE_STATES = (LoopState.STUDYING, LoopState.AWAITING_APPROVAL, LoopState.ROLLING_OUT, LoopState.WATCHING)
FINAL_STATES = tuple(s for s in LoopState.values if s not in ACTIVE_STATES)


class LoopPolicy(models.Model):
    """What the loop may do for a project (``group`` empty) or one replica group (overrides the project's)."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="loop_policies")
    group = models.CharField(max_length=100, blank=True, default="")
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.OFF)
    knobs = models.JSONField(default=dict)  # knob → {"max_factor": 2} (numbers) or {} (any value the space has)
    cooldown_seconds = models.PositiveIntegerField(default=6 * 3600)
    freeze = models.JSONField(default=list)  # [{"start", "end", "reason"}] and [{"days", "from", "to", "reason"}]
    min_confidence = models.JSONField(default=dict)  # {"model_error": 0.2, "confirmation": true}
    plan = models.JSONField(default=dict)  # the rollouts' plan, parsed
    study = models.JSONField(default=dict)  # {"trials": 30, "window_hours": 1}
    watch_seconds = models.PositiveIntegerField(default=3600)
    approval_seconds = models.PositiveIntegerField(default=3600)
    updated_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "group"], name="loop_policy_one_per_group")]
        ordering = ["project_id", "group"]

    def __str__(self) -> str:
        return f"loop policy of {self.group or 'the project'} ({self.mode})"


class Loop(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="loops")
    group = models.CharField(max_length=100)
    state = models.CharField(max_length=20, choices=LoopState.choices, default=LoopState.STUDYING)
    mode = models.CharField(max_length=16, choices=Mode.choices)
    policy = models.JSONField(default=dict)  # the policy as it was when the loop started
    paused = models.BooleanField(default=False)
    alert = models.ForeignKey("alerts.Alert", on_delete=models.SET_NULL, null=True, blank=True, related_name="loops")
    alert_fingerprint = models.CharField(max_length=64, blank=True, default="")
    slo = models.ForeignKey("slo.SLO", on_delete=models.SET_NULL, null=True, blank=True, related_name="loops")
    trigger = models.JSONField(default=dict)  # the page: component, diagnosis summary, burn rates
    study = models.ForeignKey("tuning.TuningStudy", on_delete=models.SET_NULL, null=True, blank=True,
                              related_name="loops")
    proposal = models.JSONField(default=dict)
    rollout = models.ForeignKey("rollouts.Rollout", on_delete=models.SET_NULL, null=True, blank=True,
                                related_name="loops")
    # Set by the tick that creates the loop's study or rollout, before it does, and cleared when that tick is done,
    # whatever happened: a concurrent tick sees the claim and leaves the step to it (a claim older than 10 minutes
    # is taken over: its worker died).
    claimed_at = models.DateTimeField(null=True, blank=True)
    approval_nonce = models.CharField(max_length=32, blank=True, default="")
    approval_expires_at = models.DateTimeField(null=True, blank=True)
    watch_until = models.DateTimeField(null=True, blank=True)
    restored_at = models.DateTimeField(null=True, blank=True)  # when the SLO's burn rate first fell below 1
    reason = models.TextField(blank=True, default="")  # why it ended
    version = models.PositiveIntegerField(default=0)  # every change is a conditional update on it
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # A loop never runs two changes at once on a group: one active loop per group.
            models.UniqueConstraint(fields=["project", "group"], condition=Q(state__in=ACTIVE_STATES),
                                    name="loop_one_active_per_group"),
        ]
        indexes = [models.Index(fields=["project", "group", "-created_at"]), models.Index(fields=["state"])]
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"loop {self.id} ({self.group}, {self.state})"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


class LoopStep(models.Model):
    """One step of a loop's timeline: what happened, who or what decided, why, with the figures."""

    loop = models.ForeignKey(Loop, on_delete=models.CASCADE, related_name="steps")
    at = models.DateTimeField(default=timezone.now)
    step = models.CharField(max_length=32)
    actor = models.CharField(max_length=150)  # "loop" or the user
    reason = models.TextField(blank=True, default="")
    figures = models.JSONField(default=dict, blank=True)
    delivery_ids = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["at", "id"]
