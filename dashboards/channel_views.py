"""Channel pages: the project's notification channels, a new one (its generated secret shown once), a test send,
and each channel's delivery log. Admins manage channels; the others read (without the destinations' answers)."""
from __future__ import annotations

import logging

from django.db import IntegrityError, transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_http_methods
from notify import services
from notify.api import ChannelIn, Matcher, delivery_json
from notify.channels import ChannelInputError, channel_json, clean_input
from notify.models import Channel as ChannelRow
from notify.models import ChannelKind
from notify.models import Delivery as DeliveryRow

from .access import Viewer, form_post, page
from .inputs import validate
from .views import _base

log = logging.getLogger(__name__)
FIELDS = {"name", "kind", "url", "routing_key", "severities", "matchers", "send_resolved", "enabled"}
SEVERITIES = ("page", "ticket")


def _channel(viewer: Viewer, channel_id: int) -> ChannelRow:
    channel = ChannelRow.objects.filter(pk=channel_id, project_id=viewer.project_id).first()
    if channel is None:
        raise Http404("no such channel in this project")
    return channel


@page()
def channel_list(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    channels = [channel_json(c, viewer.project, show_answers=viewer.can("admin"))
                for c in ChannelRow.objects.filter(project_id=viewer.project_id).order_by("name")]
    return render(request, "dashboards/channels.html", _base(request, viewer, "channels", channels=channels,
                                                             kinds=list(ChannelKind.values), severities=SEVERITIES,
                                                             values={"kind": "webhook", "send_resolved": True},
                                                             errors={}))


@form_post("admin", "channels", verb="need")
def channel_create(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    post = request.POST
    values = {k: post.get(k, "") for k in ("name", "kind", "url", "routing_key", "matchers")}
    values["severities"] = post.getlist("severities")
    values["send_resolved"] = post.get("send_resolved") == "on"
    data: dict = {"name": values["name"], "kind": values["kind"], "send_resolved": values["send_resolved"]}
    if values["url"]:
        data["url"] = values["url"]
    if values["routing_key"] and values["kind"] == "pagerduty":
        data["routing_key"] = values["routing_key"]
    if values["severities"]:
        data["severities"] = values["severities"]
    matchers = [line.strip() for line in values["matchers"].splitlines() if line.strip()]
    if matchers:
        data["matchers"] = matchers
    parsed, errors = validate(ChannelIn, data, FIELDS)
    created = secrets = None
    if not errors:
        fields = {k: v for k, v in parsed.model_dump(mode="python", exclude_unset=True).items() if v is not None}
        if fields.get("matchers") is not None:
            fields["matchers"] = [m.model_dump() if isinstance(m, Matcher) else m for m in parsed.matchers]
        try:
            fields, secrets = clean_input(fields)
            now = timezone.now()
            with transaction.atomic():
                created = ChannelRow.objects.create(project_id=viewer.project_id, created_at=now, updated_at=now,
                                                    **fields)
        except ChannelInputError as exc:
            errors = {"": [str(exc)]}
        except IntegrityError:
            errors = {"name": [f"a channel named {data['name']!r} already exists in this project"]}
        else:
            log.info("channel %s/%s created by %s in the dashboard", viewer.project, created.name,
                     viewer.identity.username)
    channels = [channel_json(c, viewer.project, show_answers=True)
                for c in ChannelRow.objects.filter(project_id=viewer.project_id).order_by("name")]
    context = _base(request, viewer, "channels", channels=channels, kinds=list(ChannelKind.values),
                    severities=SEVERITIES, values=values if errors else {"kind": "webhook", "send_resolved": True},
                    errors=errors, created=created, secrets=secrets)
    return render(request, "dashboards/channels.html", context, status=400 if errors else 201)


@require_http_methods(["GET", "POST"])
@page()
def channel_detail(request: HttpRequest, viewer: Viewer, channel_id: int) -> HttpResponse:
    channel = _channel(viewer, channel_id)
    admin = viewer.can("admin")
    sent = None
    if request.method == "POST":
        viewer.require("admin", "channels", verb="need")
        sent = delivery_json(services.send_test(channel), show_answers=True)
        log.info("test notification to channel %s sent by %s in the dashboard", channel.id, viewer.identity.username)
        channel.refresh_from_db()
    deliveries = [delivery_json(d, show_answers=admin) for d in DeliveryRow.objects.filter(channel=channel)
                  .order_by("-id").prefetch_related("attempt_log")[:50]]
    context = _base(request, viewer, "channels", channel=channel_json(channel, viewer.project, show_answers=admin),
                    deliveries=deliveries, sent=sent)
    return render(request, "dashboards/channel.html", context)
