"""Channel configuration: validating API input, label matchers, severity filters, and the public (secret-free) view."""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from . import http_client, signing
from .models import Channel, ChannelKind

PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
SEVERITIES = ("page", "ticket")
MATCHER_OPS = ("=", "!=", "=~", "!~")
MAX_SECRETS = 5
MAX_MATCHERS = 20
SIGNED_KINDS = (ChannelKind.WEBHOOK, ChannelKind.ALERTMANAGER)
_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MATCHER_TEXT = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_ROUTING_KEY = re.compile(r"[A-Za-z0-9]{8,64}")

CREATE_FIELDS = {"name", "kind", "url", "secrets", "routing_key", "severities", "matchers", "send_resolved",
                 "enabled", "project"}
UPDATE_FIELDS = {"name", "url", "secrets", "routing_key", "severities", "matchers", "send_resolved", "enabled",
                 "rotate_secret", "retire_secrets", "kind"}


class ChannelInputError(ValueError):
    """Invalid channel configuration; the message is meant for the API user."""


# -- matchers ---------------------------------------------------------------------------------------------------
def parse_matcher(raw) -> dict:
    """A matcher as {"name", "op", "value"}, from that object or from Alertmanager's text form name=~"value"."""
    if isinstance(raw, str):
        found = _MATCHER_TEXT.fullmatch(raw)
        if not found:
            raise ChannelInputError(f'matcher {raw!r}: expected name="value" (operators {", ".join(MATCHER_OPS)})')
        raw = {"name": found.group(1), "op": found.group(2), "value": re.sub(r"\\(.)", r"\1", found.group(3))}
    if not isinstance(raw, dict) or set(raw) - {"name", "op", "value"} or not {"name", "value"} <= set(raw):
        raise ChannelInputError('a matcher is {"name": ..., "op": "=", "value": ...} or the text name="value"')
    name, op, value = raw["name"], raw.get("op", "="), raw["value"]
    if not isinstance(name, str) or not _LABEL.fullmatch(name):
        raise ChannelInputError(f"matcher label name {name!r} is not a valid label name")
    if op not in MATCHER_OPS:
        raise ChannelInputError(f"matcher operator {op!r}: use one of {', '.join(MATCHER_OPS)}")
    if not isinstance(value, str) or len(value) > 1000:
        raise ChannelInputError(f"matcher {name}: the value must be a string of at most 1000 characters")
    if op in ("=~", "!~"):
        try:
            re.compile(value)
        except re.error as exc:
            raise ChannelInputError(f"matcher {name}{op}: invalid regular expression ({exc})") from None
    return {"name": name, "op": op, "value": value}


def matcher_matches(matcher: dict, labels: dict) -> bool:
    value = str(labels.get(matcher["name"], ""))  # a missing label matches "" as in Alertmanager
    op = matcher["op"]
    if op == "=":
        return value == matcher["value"]
    if op == "!=":
        return value != matcher["value"]
    hit = re.fullmatch(matcher["value"], value) is not None
    return hit if op == "=~" else not hit


def channel_accepts(channel: Channel, event: dict, severity: str) -> bool:
    """Whether an event goes to this channel: enabled, severity filter, resolved notices, label matchers."""
    if not channel.enabled:
        return False
    if channel.severities and severity not in channel.severities:
        return False
    if event.get("status") == "resolved" and not channel.send_resolved:
        return False
    labels = event.get("labels") or {}
    return all(matcher_matches(m, labels) for m in channel.matchers)


# -- input ------------------------------------------------------------------------------------------------------
def _check_url(url, kind: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ChannelInputError("url is required (http:// or https://)")
    url = url.strip()
    if len(url) > 2048:
        raise ChannelInputError("url is longer than 2048 characters")
    try:
        # Only what can be judged without DNS: the scheme, the syntax, IP-literal and metadata hosts. Names
        # are resolved and checked again before every send.
        http_client.check_url(url, http_client.policy_from_settings(), resolve=False)
    except http_client.RequestRefused as exc:
        raise ChannelInputError(f"url: {exc}") from None
    return url


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ChannelInputError(f"{name} must be true or false")
    return value


def _check_secrets(value) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ChannelInputError("secrets must be a non-empty list of 'whsec_...' strings")
    if len(value) > MAX_SECRETS:
        raise ChannelInputError(f"at most {MAX_SECRETS} secrets at a time")
    for secret in value:
        try:
            signing.validate_secret(secret)
        except ValueError as exc:
            raise ChannelInputError(f"secrets: {exc}") from None
    if len(set(value)) != len(value):
        raise ChannelInputError("secrets: the same secret is listed twice")
    return list(value)


def clean_input(data: dict, channel: Channel | None = None) -> tuple[dict, list[str]]:
    """Validate a create (``channel`` None) or update body. Returns the model fields to set and the secrets that
    were generated here (to be shown once). Raises ChannelInputError with a message for the user."""
    if not isinstance(data, dict):
        raise ChannelInputError("the body must be a JSON object")
    allowed = CREATE_FIELDS if channel is None else UPDATE_FIELDS
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ChannelInputError(f"unknown field(s): {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")
    fields: dict = {}
    generated: list[str] = []
    if channel is None:
        kind = data.get("kind")
        if kind not in ChannelKind.values:
            raise ChannelInputError(f"kind is required: one of {', '.join(ChannelKind.values)}")
    else:
        kind = channel.kind
        if "kind" in data and data["kind"] != kind:
            raise ChannelInputError("kind cannot be changed; create a new channel instead")
    if channel is None or "name" in data:
        name = data.get("name")
        if not isinstance(name, str) or not name.strip() or len(name.strip()) > 100:
            raise ChannelInputError("name is required: 1 to 100 characters")
        fields["name"] = name.strip()
    if channel is None:
        fields["kind"] = kind
    if channel is None or "url" in data:
        url = data.get("url")
        if kind == ChannelKind.PAGERDUTY and url is None:
            url = PAGERDUTY_EVENTS_URL
        fields["url"] = _check_url(url, kind)
    if "routing_key" in data or (channel is None and kind == ChannelKind.PAGERDUTY):
        if kind != ChannelKind.PAGERDUTY:
            raise ChannelInputError("routing_key applies to pagerduty channels only")
        key = data.get("routing_key")
        if not isinstance(key, str) or not _ROUTING_KEY.fullmatch(key):
            raise ChannelInputError("routing_key is required for pagerduty: the integration key (8-64 letters/digits)")
        fields["routing_key"] = key
    secrets_given = "secrets" in data
    if secrets_given or data.get("rotate_secret") or data.get("retire_secrets"):
        if kind not in SIGNED_KINDS:
            raise ChannelInputError(f"secrets apply to {' and '.join(SIGNED_KINDS)} channels only")
    if secrets_given:
        fields["secrets"] = _check_secrets(data["secrets"])
    elif channel is None and kind in SIGNED_KINDS:
        generated.append(signing.generate_secret())
        fields["secrets"] = list(generated)
    if channel is not None:
        current = list(fields.get("secrets", channel.secrets))
        if "rotate_secret" in data and _check_bool(data["rotate_secret"], "rotate_secret"):
            new = signing.generate_secret()
            generated.append(new)
            current = (current + [new])[-MAX_SECRETS:]
        if "retire_secrets" in data and _check_bool(data["retire_secrets"], "retire_secrets"):
            current = current[-1:]  # keep the newest only: the rotation is over
        if current != list(channel.secrets):
            fields["secrets"] = current
    if "severities" in data:
        severities = data["severities"]
        if not isinstance(severities, list) or any(s not in SEVERITIES for s in severities):
            raise ChannelInputError(f"severities is a list of {', '.join(SEVERITIES)} (empty = every severity)")
        fields["severities"] = sorted(set(severities), key=SEVERITIES.index)
    if "matchers" in data:
        matchers = data["matchers"]
        if not isinstance(matchers, list) or len(matchers) > MAX_MATCHERS:
            raise ChannelInputError(f"matchers is a list of at most {MAX_MATCHERS} matchers")
        fields["matchers"] = [parse_matcher(m) for m in matchers]
    if "send_resolved" in data:
        fields["send_resolved"] = _check_bool(data["send_resolved"], "send_resolved")
    if "enabled" in data:
        fields["enabled"] = _check_bool(data["enabled"], "enabled")
    return fields, generated


# -- output -----------------------------------------------------------------------------------------------------
def redact_url(url: str, kind: str) -> str:
    """A URL safe to show: no password, no query values, and no Slack webhook path (the path is the secret)."""
    try:
        parts = urlsplit(url)
        netloc = parts.hostname or ""
        if ":" in netloc:
            netloc = f"[{netloc}]"
        if parts.port:
            netloc += f":{parts.port}"
        if parts.username:
            netloc = f"{parts.username}:***@{netloc}" if parts.password else f"{parts.username}@{netloc}"
    except ValueError:
        return "(invalid URL)"
    path = parts.path
    if kind == ChannelKind.SLACK and path.count("/") > 2:
        path = "/".join(path.split("/")[:2]) + "/***"
    query = "&".join(f"{pair.split('=', 1)[0]}=***" for pair in parts.query.split("&") if pair) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, path, query, ""))


def secret_hint(secret: str) -> str:
    return secret[:10] + "…"


def _iso(value) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


_ANSWER = re.compile(r"(HTTP \d{3}): .*", re.S)


def without_answer(error: str | None) -> str | None:
    """An error text without what the destination answered ("HTTP 500: <its body>" → "HTTP 500"): that part is
    for the project's admins only (a channel pointed at an internal service must not let readers read it)."""
    return _ANSWER.sub(r"\1 (the answer is shown to the project's admins)", error) if error else error


def channel_json(channel: Channel, project_name: str | None = None, *, show_answers: bool = True) -> dict:
    """The channel's public view; with show_answers False (a non-admin), its last error without the answer."""
    out = {
        "id": channel.id,
        "project": project_name or channel.project.name,
        "name": channel.name,
        "kind": channel.kind,
        "url": redact_url(channel.url, channel.kind),
        "enabled": channel.enabled,
        "disabled_reason": channel.disabled_reason or None,
        "severities": list(channel.severities),
        "matchers": list(channel.matchers),
        "send_resolved": channel.send_resolved,
        "secret_hints": [secret_hint(s) for s in channel.secrets],
        "last_error": (channel.last_error if show_answers else without_answer(channel.last_error)) or None,
        "last_error_at": _iso(channel.last_error_at),
        "last_success_at": _iso(channel.last_success_at),
        "created_at": _iso(channel.created_at),
        "updated_at": _iso(channel.updated_at),
    }
    if channel.kind == ChannelKind.PAGERDUTY:
        out["routing_key_hint"] = (channel.routing_key[:4] + "…") if channel.routing_key else None
    return out
