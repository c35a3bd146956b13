"""Throttling of failed authentication: API tokens per client address (here), and logins per user and address
(django-axes, configured in settings; it asks `client_address` too).

API tokens: after API_AUTH["FAILURE_LIMIT"] failed attempts from one address within FAILURE_WINDOW_SECONDS, a bad
token from that address gets 429 with Retry-After for COOLOFF_SECONDS instead of 401. Only failures are throttled:
a valid token is resolved first and always let in, so one misconfigured script behind a shared NAT or an untrusted
proxy cannot lock the address's other users out (tokens carry 256 random bits: the throttle bounds what bad
attempts cost, guessing is hopeless anyway). Counts live in Django's cache: per process with the default
local-memory cache, shared between processes with CACHE_URL=redis://… (docs: "Login and token throttling").
"""
from __future__ import annotations

import ipaddress
import logging
import math
import time

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest

log = logging.getLogger(__name__)


def client_address(request: HttpRequest) -> str:
    """The client's IP address: REMOTE_ADDR, or with OBSERVATORY_TRUSTED_PROXIES = n > 0 the n-th address from
    the right of X-Forwarded-For (what the nearest trusted proxy saw)."""
    remote = request.META.get("REMOTE_ADDR", "") or "unknown"
    hops = settings.TRUSTED_PROXIES
    if hops <= 0:
        return remote
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    if len(forwarded) < hops:
        return remote
    candidate = forwarded[-hops]
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        return remote


def axes_client_address(request: HttpRequest, *args) -> str | None:
    """django-axes's AXES_CLIENT_IP_CALLABLE: the same client address as the API's throttle, or None when the
    request has none (Django's test client logging in; PostgreSQL's inet column takes no "unknown")."""
    address = client_address(request)
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return None


def _keys(address: str) -> tuple[str, str]:
    return f"api-auth-failures:{address}", f"api-auth-blocked:{address}"


def api_blocked_for(address: str) -> int:
    """Seconds this address's bad tokens are still answered 429 (0: not blocked)."""
    until = cache.get(_keys(address)[1])
    if until is None:
        return 0
    remaining = until - time.time()
    return math.ceil(remaining) if remaining > 0 else 0


def api_failure(address: str) -> None:
    """Count a failed API authentication; block the address once it has failed too often."""
    config = settings.API_AUTH
    failures_key, blocked_key = _keys(address)
    window = config["FAILURE_WINDOW_SECONDS"]
    if cache.add(failures_key, 1, timeout=window):
        count = 1
    else:
        try:
            count = cache.incr(failures_key)
        except ValueError:  # expired between add and incr
            cache.add(failures_key, 1, timeout=window)
            count = 1
    if count >= config["FAILURE_LIMIT"]:
        cooloff = config["COOLOFF_SECONDS"]
        cache.set(blocked_key, time.time() + cooloff, timeout=cooloff)
        cache.delete(failures_key)
        log.warning("API authentication: %d failures from %s within %ds; refusing it for %ds (429)",
                    count, address, window, cooloff)
