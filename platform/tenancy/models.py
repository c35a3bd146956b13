"""Tenancy records: a key is random, shown once, stored only as its SHA-256."""
from __future__ import annotations

import hashlib
import secrets as _secrets

from django.conf import settings
from django.db import models
from django.utils import timezone


def hash_secret(raw: str) -> str:
    # Keys carry 256 random bits, so a plain SHA-256 is safe to store and fast to look up.
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


class Project(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    retention_days = models.PositiveSmallIntegerField(default=0, help_text="0 = the platform default")

    def __str__(self) -> str:
        return self.name

    @property
    def effective_retention_days(self) -> int:
        return self.retention_days or settings.CLICKHOUSE_RETENTION_DAYS


class Role(models.TextChoices):
    VIEWER = "viewer", "viewer"
    OPERATOR = "operator", "operator"
    ADMIN = "admin", "admin"


ROLE_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "project"], name="one_membership_per_project")]


class IngestKey(models.Model):
    PREFIX = "lok_"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="ingest_keys")
    name = models.CharField(max_length=100, blank=True)
    display_prefix = models.CharField(max_length=16)
    key_hash = models.CharField(max_length=64, unique=True)
    HASH_FIELD = "key_hash"
    created_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)

    @classmethod
    def issue(cls, project: Project, name: str = "") -> tuple["IngestKey", str]:
        """Create a key; the raw key is returned once and never stored."""
        raw = cls.PREFIX + _secrets.token_urlsafe(32)
        key = cls.objects.create(project=project, name=name, display_prefix=raw[:12], key_hash=hash_secret(raw))
        return key, raw

    def revoke(self) -> None:
        self.revoked_at = timezone.now()
        self.save(update_fields=["revoked_at"])


class ApiToken(models.Model):
    PREFIX = "lot_"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    name = models.CharField(max_length=100, blank=True)
    display_prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    HASH_FIELD = "token_hash"
    created_at = models.DateTimeField(default=timezone.now)
    # Kept to the minute (tenancy.keys): when the token last authenticated a request.
    last_used_at = models.DateTimeField(null=True, blank=True)
    # None: never expires. An expired token is refused with 401 saying so.
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    @classmethod
    def issue(cls, user, role: str, name: str = "", expires_at=None) -> tuple["ApiToken", str]:
        raw = cls.PREFIX + _secrets.token_urlsafe(32)
        token = cls.objects.create(user=user, role=role, name=name, display_prefix=raw[:12], token_hash=hash_secret(raw),
                                   expires_at=expires_at)
        return token, raw

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"

    def revoke(self) -> None:
        self.revoked_at = timezone.now()
        self.save(update_fields=["revoked_at"])
