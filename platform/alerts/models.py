"""Alerts (one row per fingerprint, reused across firing episodes), their transitions, and silences."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from .matchers import parse_matcher


class AlertState(models.TextChoices):
    PENDING = "pending", "pending"  # the condition holds, not yet for long enough
    FIRING = "firing", "firing"
    RESOLVED = "resolved", "resolved"  # fired, then the condition cleared
    INACTIVE = "inactive", "inactive"  # was pending, cleared before firing (never notified)


class AlertKind(models.TextChoices):
    SLO_BURN = "slo_burn", "SLO burn rate"
    LATENCY_REGRESSION = "latency_regression", "latency regression"
    ENGINE_MODEL_DRIFT = "engine_model_drift", "engine model drift"


class Severity(models.TextChoices):
    PAGE = "page", "page"
    TICKET = "ticket", "ticket"


class Alert(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="alerts")
    slo = models.ForeignKey("slo.SLO", on_delete=models.SET_NULL, null=True, blank=True, related_name="alerts")
    kind = models.CharField(max_length=32, choices=AlertKind.choices)
    # sha256 of project, kind, SLO id (or regression key) and severity: the same alert across episodes.
    fingerprint = models.CharField(max_length=64, unique=True)
    severity = models.CharField(max_length=16, choices=Severity.choices)
    state = models.CharField(max_length=16, choices=AlertState.choices, default=AlertState.PENDING)
    # Bumped by every claimed change (transition or notification): the conditional UPDATEs filter on it.
    version = models.PositiveBigIntegerField(default=0)
    episode = models.PositiveIntegerField(default=1)
    labels = models.JSONField(default=dict)
    annotations = models.JSONField(default=dict)
    diagnosis = models.JSONField(null=True, blank=True)
    # What the lifecycle needs to diagnose again (filters, SLI, windows) and, for regressions, the frozen baseline.
    context = models.JSONField(default=dict)
    # The newest evaluation's figures (burn rates, budget, p50s).
    last_values = models.JSONField(default=dict)
    started_at = models.DateTimeField()  # this episode became pending
    fired_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    last_evaluated_at = models.DateTimeField(null=True, blank=True)
    last_notified_at = models.DateTimeField(null=True, blank=True)  # this episode's last firing notification
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["project", "state"], name="alert_project_state"),
            models.Index(fields=["state", "last_notified_at"], name="alert_state_notified"),
            models.Index(fields=["slo", "severity"], name="alert_slo_severity"),
        ]

    def __str__(self) -> str:
        return f"{self.labels.get('alertname', self.kind)} {self.fingerprint[:12]} ({self.state})"


class AlertTransition(models.Model):
    """One change of an alert's state, or one repeat notification of a firing alert (from = to = firing)."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="transitions")
    from_state = models.CharField(max_length=16, blank=True)  # "" when the alert row was created
    to_state = models.CharField(max_length=16)
    at = models.DateTimeField()
    reason = models.CharField(max_length=300, blank=True)
    episode = models.PositiveIntegerField(default=1)
    # Set when a notification event was produced (notified or muted); unique per transition or repeat.
    event_id = models.UUIDField(null=True, blank=True, unique=True)
    notified = models.BooleanField(default=False)
    muted = models.JSONField(default=dict, blank=True)  # {"silences": [ids]} or {"inhibited_by": fingerprint}
    delivery_ids = models.JSONField(default=list, blank=True)
    values = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["alert", "at"], name="alert_transition_at")]


class Silence(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="silences")
    matchers = models.JSONField()  # [{"name", "op", "value"}], op one of = != =~ !~
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+")
    created_by_name = models.CharField(max_length=150, blank=True)
    comment = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expired_at = models.DateTimeField(null=True, blank=True)  # ended early by DELETE
    expired_by_name = models.CharField(max_length=150, blank=True)

    class Meta:
        indexes = [models.Index(fields=["project", "ends_at"], name="silence_project_ends")]

    def parsed_matchers(self):
        return [parse_matcher(item) for item in self.matchers]

    def status(self, now=None) -> str:
        now = now or timezone.now()
        if self.ends_at <= now:
            return "expired"
        if self.starts_at > now:
            return "pending"
        return "active"
