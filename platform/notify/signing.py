"""Standard Webhooks signatures (https://www.standardwebhooks.com/): sign outgoing deliveries, verify them in receivers.

A delivery carries three headers:

    webhook-id:        the delivery's id, the same on every retry (receivers deduplicate on it)
    webhook-timestamp: unix seconds when this attempt was signed
    webhook-signature: "v1,<base64 HMAC-SHA256 of '<id>.<timestamp>.<body>'>", one entry per secret,
                       space-separated (during a rotation every active secret signs, so a receiver holding
                       either the old or the new secret verifies)

A secret is ``whsec_`` followed by base64; the HMAC key is the base64-decoded part. This module has no
Django in it, so receivers can copy it as is.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as _secrets
import time
from collections.abc import Iterable, Mapping

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
DEFAULT_TOLERANCE_SECONDS = 300
# The spec asks for keys between 24 and 64 bytes; we generate 32.
MIN_KEY_BYTES, MAX_KEY_BYTES, NEW_KEY_BYTES = 24, 64, 32


class WebhookVerificationError(Exception):
    """The delivery's headers or signature do not check out; the message says why."""


def generate_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(NEW_KEY_BYTES)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key of a secret (``whsec_<base64>``; the bare base64 part is accepted too)."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a webhook secret is 'whsec_' followed by standard base64") from None


def validate_secret(secret: object) -> str:
    """A secret given by a user, checked: ``whsec_`` prefix, valid base64, 24 to 64 bytes once decoded."""
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise ValueError("a webhook secret is a string 'whsec_' followed by standard base64")
    key = secret_key(secret)
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(
            f"a webhook secret must decode to {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes (this one has {len(key)})"
        )
    return secret


def _to_bytes(payload: bytes | str) -> bytes:
    return payload.encode("utf-8") if isinstance(payload, str) else payload


def _signature(key: bytes, msg_id: str, timestamp: int, payload: bytes) -> str:
    content = f"{msg_id}.{timestamp}.".encode() + payload
    return base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode("ascii")


def sign(msg_id: str, timestamp: int, payload: bytes | str, secrets: Iterable[str]) -> str:
    """The ``webhook-signature`` header value: ``v1,<sig>`` per secret, space-separated, in the given order."""
    body = _to_bytes(payload)
    parts = [f"{SIGNATURE_VERSION},{_signature(secret_key(s), msg_id, int(timestamp), body)}" for s in secrets]
    if not parts:
        raise ValueError("signing needs at least one secret")
    return " ".join(parts)


def signature_headers(msg_id: str, payload: bytes | str, secrets: Iterable[str], timestamp: int | None = None) -> dict:
    """``webhook-id`` and ``webhook-timestamp``, plus ``webhook-signature`` when there is a secret."""
    timestamp = int(time.time()) if timestamp is None else int(timestamp)
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(timestamp)}
    secrets = list(secrets)
    if secrets:
        headers["webhook-signature"] = sign(msg_id, timestamp, payload, secrets)
    return headers


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def verify(
    payload: bytes | str,
    headers: Mapping[str, str],
    secrets: str | Iterable[str],
    tolerance: float = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> bool:
    """Check a received delivery; True when one of its signatures matches one of ``secrets``.

    Raises WebhookVerificationError (missing headers, a timestamp outside ``tolerance`` seconds of now
    either way, which defeats replays, or no matching signature). Verify the raw body exactly as received:
    re-serialising parsed JSON changes the bytes.
    """
    msg_id = _header(headers, "webhook-id")
    timestamp_text = _header(headers, "webhook-timestamp")
    signature_header = _header(headers, "webhook-signature")
    missing = [name for name, value in (("webhook-id", msg_id), ("webhook-timestamp", timestamp_text),
                                         ("webhook-signature", signature_header)) if not value]
    if missing:
        raise WebhookVerificationError(f"missing header(s): {', '.join(missing)}")
    try:
        timestamp = int(timestamp_text)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not an integer (unix seconds)") from None
    now = time.time() if now is None else now
    if timestamp < now - tolerance:
        raise WebhookVerificationError("webhook-timestamp is too old (possible replay)")
    if timestamp > now + tolerance:
        raise WebhookVerificationError("webhook-timestamp is too far in the future")
    body = _to_bytes(payload)
    keys = [secret_key(s) for s in ([secrets] if isinstance(secrets, str) else secrets)]
    expected = [_signature(key, msg_id, timestamp, body) for key in keys]
    for entry in signature_header.split(" "):
        version, _, candidate = entry.partition(",")
        if version != SIGNATURE_VERSION:
            continue
        if any(hmac.compare_digest(candidate.encode(), sig.encode()) for sig in expected):
            return True
    raise WebhookVerificationError("no signature matches (wrong secret or altered body)")
