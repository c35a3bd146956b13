"""JSON API for channels and their delivery log: viewers read, admins manage (Authorization: Bearer <api token>)."""
from __future__ import annotations

from django.db import IntegrityError, transaction
from django.http import HttpRequest
from django.utils import timezone
from observatory.jsonapi import ApiError, json_body, json_view
from tenancy.keys import ApiIdentity
from tenancy.models import Project
from traces.api import project_for

from . import services
from .channels import ChannelInputError, channel_json, clean_input, redact_url
from .models import Channel, Delivery, DeliveryStatus

DELIVERY_PAGE_MAX = 200
# A channel's input errors are written for the API user: 400 with their message.
_ERRORS = {ChannelInputError: lambda exc: ApiError(400, str(exc))}


def _require(identity: ApiIdentity, project_id: int, role: str) -> None:
    if not identity.can(project_id, role):
        raise ApiError(403, f"this needs the {role} role in the project (yours: {identity.role_in(project_id)})")


def _channel_for(identity: ApiIdentity, channel_id: int) -> Channel:
    """The channel, if it belongs to one of the token's projects; otherwise 404 (existence is not revealed)."""
    channel = Channel.objects.select_related("project").filter(id=channel_id).first()
    if channel is None or identity.role_in(channel.project_id) is None:
        raise ApiError(404, f"no channel {channel_id} for this token")
    return channel


def _iso(value) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def delivery_json(delivery: Delivery, with_log: bool = True) -> dict:
    out = {
        "id": delivery.id,
        "channel": delivery.channel_id,
        "webhook_id": delivery.webhook_id,
        "event_id": delivery.event_id,
        "fingerprint": delivery.fingerprint,
        "event_status": (delivery.event or {}).get("status"),
        "severity": delivery.severity,
        "status": delivery.status,
        "attempts": delivery.attempts,
        "next_attempt_at": _iso(delivery.next_attempt_at) if delivery.status == DeliveryStatus.PENDING else None,
        "last_status_code": delivery.last_status_code,
        "last_error": delivery.last_error or None,
        "last_duration_ms": delivery.last_duration_ms,
        "is_test": delivery.is_test,
        "created_at": _iso(delivery.created_at),
        "updated_at": _iso(delivery.updated_at),
        "delivered_at": _iso(delivery.delivered_at),
    }
    if with_log:
        out["log"] = [
            {"attempt": a.number, "started_at": _iso(a.started_at), "duration_ms": a.duration_ms,
             "outcome": a.outcome, "status_code": a.status_code, "error": a.error or None,
             "url": a.url or None, "response_excerpt": a.response_excerpt or None}
            for a in delivery.attempt_log.all()
        ]
    return out


@json_view("GET", "POST", errors=_ERRORS)
def channels_view(request: HttpRequest, identity: ApiIdentity):
    if request.method == "POST":
        data = json_body(request)
        in_body = data.pop("project", None)
        if in_body is not None:
            if not isinstance(in_body, str):
                raise ApiError(400, "project must be a project name")
            if request.GET.get("project") not in (None, in_body):
                raise ApiError(400, "project in the body and ?project= differ")
            project_id = identity.project_names.get(in_body)
            if project_id is None:
                raise ApiError(404, f"no project named {in_body!r} for this token")
        else:
            project_id = project_for(request, identity)
        _require(identity, project_id, "admin")
        fields, generated = clean_input(data)
        now = timezone.now()
        try:
            with transaction.atomic():
                channel = Channel.objects.create(project_id=project_id, created_at=now, updated_at=now, **fields)
        except IntegrityError:
            raise ApiError(409, f"a channel named {fields['name']!r} already exists in this project") from None
        body = {"channel": channel_json(channel, Project.objects.get(id=project_id).name)}
        if generated:
            body["secrets"] = generated
            body["note"] = "the secret is shown only now; store it where your receiver verifies signatures"
        return body, 201
    project_id = project_for(request, identity)
    project_name = Project.objects.get(id=project_id).name
    return {"channels": [channel_json(c, project_name) for c in Channel.objects.filter(project_id=project_id)]}


@json_view("GET", "PATCH", "DELETE", errors=_ERRORS)
def channel_view(request: HttpRequest, identity: ApiIdentity, channel_id: int):
    channel = _channel_for(identity, channel_id)
    if request.method == "GET":
        return {"channel": channel_json(channel)}
    _require(identity, channel.project_id, "admin")
    if request.method == "DELETE":
        channel.delete()
        return None
    fields, generated = clean_input(json_body(request), channel)
    now = timezone.now()
    disabling = fields.get("enabled") is False and channel.enabled
    if fields.get("enabled") is True:
        fields["disabled_reason"] = ""
    if disabling:
        del fields["enabled"]  # disable_channel sets it with a reason and ends the pending deliveries
    for name, value in fields.items():
        setattr(channel, name, value)
    channel.updated_at = now
    try:
        with transaction.atomic():
            channel.save()
            if disabling:
                services.disable_channel(channel, f"disabled by {identity.username}", now)
    except IntegrityError:
        raise ApiError(409, f"a channel named {channel.name!r} already exists in this project") from None
    channel.refresh_from_db()
    body = {"channel": channel_json(channel)}
    if generated:
        body["new_secret"] = generated[-1]
        body["note"] = ("the new secret is shown only now; every listed secret signs until you retire the old ones "
                        "(PATCH {\"retire_secrets\": true})")
    return body


@json_view("POST", errors=_ERRORS)
def channel_test_view(request: HttpRequest, identity: ApiIdentity, channel_id: int):
    channel = _channel_for(identity, channel_id)
    _require(identity, channel.project_id, "admin")
    delivery = services.send_test(channel)
    return {"delivery": delivery_json(delivery), "url": redact_url(channel.url, channel.kind)}


@json_view("GET", errors=_ERRORS)
def channel_deliveries_view(request: HttpRequest, identity: ApiIdentity, channel_id: int):
    channel = _channel_for(identity, channel_id)
    deliveries = Delivery.objects.filter(channel=channel)
    status = request.GET.get("status")
    if status:
        if status not in DeliveryStatus.values:
            raise ApiError(400, f"status is one of {', '.join(DeliveryStatus.values)}")
        deliveries = deliveries.filter(status=status)
    try:
        limit = int(request.GET.get("limit", 50))
        before = int(request.GET["before"]) if request.GET.get("before") else None
    except ValueError:
        raise ApiError(400, "limit and before must be integers") from None
    if not 1 <= limit <= DELIVERY_PAGE_MAX:
        raise ApiError(400, f"limit must be between 1 and {DELIVERY_PAGE_MAX}")
    if before is not None:
        deliveries = deliveries.filter(id__lt=before)
    page = list(deliveries.order_by("-id").prefetch_related("attempt_log")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return {
        "channel": channel.id,
        "deliveries": [delivery_json(d) for d in page],
        "next_before": page[-1].id if more and page else None,
    }
