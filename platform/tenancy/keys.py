"""Resolving bearer credentials to a project (ingest) or to a user's projects and role (API)."""
from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from .models import ROLE_RANK, ApiToken, IngestKey, Membership, Role, hash_secret


@dataclasses.dataclass(frozen=True)
class IngestIdentity:
    project_id: int
    retention_days: int


_ingest_cache: dict[str, tuple[float, IngestIdentity | None]] = {}
_ingest_cache_lock = threading.Lock()
_INGEST_CACHE_MAX = 10_000


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def resolve_ingest_key(raw: str | None) -> IngestIdentity | None:
    """The project an ingest key writes to, or None. Answers are cached briefly (revocation
    takes effect within INGEST_KEY_CACHE_SECONDS) so the hot path does not hit the database."""
    if not raw or len(raw) > 200:
        return None
    digest = hash_secret(raw)
    now = time.monotonic()
    cached = _ingest_cache.get(digest)
    if cached is not None and cached[0] > now:
        return cached[1]
    key = (
        IngestKey.objects.select_related("project")
        .filter(key_hash=digest, revoked_at__isnull=True)
        .first()
    )
    identity = (
        IngestIdentity(project_id=key.project_id, retention_days=key.project.effective_retention_days) if key else None
    )
    with _ingest_cache_lock:
        if len(_ingest_cache) >= _INGEST_CACHE_MAX:
            _ingest_cache.clear()
        _ingest_cache[digest] = (now + settings.INGEST["KEY_CACHE_SECONDS"], identity)
    return identity


def forget_cached_keys() -> None:
    with _ingest_cache_lock:
        _ingest_cache.clear()


@dataclasses.dataclass(frozen=True)
class ApiIdentity:
    user_id: int
    username: str
    token_role: str
    # project id -> effective role (the lower of the membership role and the token's role)
    projects: dict[int, str]
    project_names: dict[str, int]

    def role_in(self, project_id: int) -> str | None:
        return self.projects.get(project_id)

    def can(self, project_id: int, needed: str) -> bool:
        role = self.projects.get(project_id)
        return role is not None and ROLE_RANK[Role(role)] >= ROLE_RANK[Role(needed)]


class TokenExpired(Exception):
    """A known API token past its expiry; the message says when it expired."""


LAST_USED_RESOLUTION = dt.timedelta(minutes=1)


def resolve_api_token(raw: str | None) -> ApiIdentity | None:
    """The identity of an API token, or None (unknown, revoked, inactive user); TokenExpired when it expired.
    Notes when it was used, to the minute (one write a minute per token at most)."""
    if not raw or len(raw) > 200:
        return None
    token = (
        ApiToken.objects.select_related("user")
        .filter(token_hash=hash_secret(raw), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if token is None:
        return None
    now = timezone.now()
    if token.expires_at is not None and token.expires_at <= now:
        raise TokenExpired(f"this API token ({token.display_prefix}…) expired at "
                           f"{token.expires_at.isoformat().replace('+00:00', 'Z')}; "
                           "create a new one (manage.py create_api_token)")
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    cap = ROLE_RANK[Role(token.role)]
    projects: dict[int, str] = {}
    names: dict[str, int] = {}
    for membership in Membership.objects.filter(Q(user_id=token.user_id)).select_related("project"):
        effective = membership.role if ROLE_RANK[Role(membership.role)] <= cap else token.role
        projects[membership.project_id] = effective
        names[membership.project.name] = membership.project_id
    return ApiIdentity(token.user_id, token.user.username, token.role, projects, names)


class SecretNotFound(LookupError):
    """No single key or token matches what was given; the message says why and what to pass instead."""


def find_secret(model: type[ApiToken] | type[IngestKey], value: str, *, what: str, noun: str, owner: str,
                example: str):
    """The one API token or ingest key whose full value or display prefix (its first 12 characters) is ``value``,
    for the revoke commands. Prefixes carry 48 random bits, so a shared one is rare; a secret the caller did not
    single out is never chosen (SecretNotFound)."""
    value = value.strip()
    if not value:
        raise SecretNotFound(f"give the {noun}'s display prefix (e.g. {example}) or the full {noun}")
    rows = model.objects.select_related(owner)
    by_hash = rows.filter(**{model.HASH_FIELD: hash_secret(value)}).first()
    if by_hash is not None:
        return by_hash
    matches = list(rows.filter(display_prefix=value).order_by("id"))
    if not matches:
        raise SecretNotFound(f"no {what} with the prefix or value {value[:12]!r}")
    active = [row for row in matches if row.revoked_at is None]
    if len(active) > 1 or (not active and len(matches) > 1):
        owners = ", ".join(sorted({str(getattr(row, owner)) for row in matches}))
        raise SecretNotFound(f"{len(matches)} {what}s share the prefix {value!r} ({owner}s: {owners}); pass the full "
                             f"{noun}")
    return active[0] if active else matches[0]
