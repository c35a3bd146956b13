"""Channels (where a project's alerts go), deliveries (one row per event and channel, written before sending)
and the log of every attempt."""
from __future__ import annotations

import uuid

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils import timezone


class ChannelKind(models.TextChoices):
    WEBHOOK = "webhook", "generic JSON webhook (Standard Webhooks signed)"
    ALERTMANAGER = "alertmanager", "Alertmanager v4 webhook JSON"
    SLACK = "slack", "Slack incoming webhook"
    PAGERDUTY = "pagerduty", "PagerDuty Events API v2"


class Channel(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="notify_channels")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=16, choices=ChannelKind.choices)
    url = models.CharField(max_length=2048)
    # Standard Webhooks secrets ("whsec_<base64>"), oldest first; every one of them signs each delivery.
    secrets = models.JSONField(default=list, blank=True)
    routing_key = models.CharField(max_length=64, blank=True, help_text="PagerDuty integration (routing) key")
    severities = models.JSONField(default=list, blank=True, help_text='e.g. ["page"]; empty = every severity')
    # [{"name": "service", "op": "=", "value": "chat"}, ...]; ops =, !=, =~, !~ (regex fully anchored)
    matchers = models.JSONField(default=list, blank=True)
    send_resolved = models.BooleanField(default=True)
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(max_length=500, blank=True)
    last_error = models.CharField(max_length=1000, blank=True)
    last_error_at = models.DateTimeField(null=True, blank=True)
    last_success_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="notify_channel_name_per_project")]
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # waiting for next_attempt_at
    SENDING = "sending"  # claimed by a worker until lease_expires_at
    SUCCEEDED = "succeeded"  # a 2xx answer
    FAILED = "failed"  # a permanent error, or a test send that did not succeed: not retried
    DEAD = "dead"  # retries exhausted, channel disabled, or superseded by a newer event


class Delivery(models.Model):
    channel = models.ForeignKey(Channel, on_delete=models.CASCADE, related_name="deliveries")
    # webhook-id: the idempotency key receivers deduplicate on, the same on every retry.
    uid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    event = models.JSONField(encoder=DjangoJSONEncoder)  # the neutral event, as it was when enqueued
    event_id = models.CharField(max_length=64)
    fingerprint = models.CharField(max_length=128, blank=True)
    severity = models.CharField(max_length=16, blank=True)
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    claim_token = models.UUIDField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=1000, blank=True)
    last_duration_ms = models.FloatField(null=True, blank=True)
    is_test = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["channel", "event_id"], name="notify_one_delivery_per_event")]
        indexes = [
            models.Index(fields=["status", "next_attempt_at"], name="notify_due_idx"),
            models.Index(fields=["channel", "fingerprint", "status"], name="notify_fingerprint_idx"),
            models.Index(fields=["status", "updated_at"], name="notify_finished_idx"),  # retention
        ]
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"delivery {self.id} of {self.event_id} to {self.channel_id}: {self.status}"

    @property
    def webhook_id(self) -> str:
        return f"msg_{self.uid.hex}"


class DeliveryAttempt(models.Model):
    class Outcome(models.TextChoices):
        SUCCEEDED = "succeeded"
        TRANSIENT = "transient"  # retried later
        PERMANENT = "permanent"  # 4xx other than 408/409/425/429, or a final 3xx
        GONE = "gone"  # 410: the channel is disabled
        REFUSED = "refused"  # not sent: SSRF rules, bad URL, too many redirects, rendering error

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.FloatField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=1000, blank=True)
    url = models.CharField(max_length=2048, blank=True)  # where the answer came from (after redirects), redacted
    response_excerpt = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["number", "id"]
