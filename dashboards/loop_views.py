"""Loop pages: the project's loop policies and loops (state refreshed while one runs); a loop: its trigger, its
study, proposal and rollout, the timeline of its steps with who or what decided and why, and the controls
(operators pause; admins resume, end, approve, deny); an approval link's page, which shows what the link names and
decides only on an admin's POST (a GET never acts)."""
from __future__ import annotations

import logging

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_http_methods
from loops import service
from loops.models import ACTIVE_STATES, Loop, LoopPolicy

from .access import Viewer, page
from .views import polled_page

log = logging.getLogger(__name__)
CONTROLS = {"pause": ("operator", service.pause), "resume": ("admin", service.resume),
            "end": ("admin", service.end),
            "approve": ("admin", lambda loop, who: service.decide(loop, approve=True, actor=who)),
            "deny": ("admin", lambda loop, who: service.decide(loop, approve=False, actor=who))}


def _loop(viewer: Viewer, loop_id: int) -> Loop:
    loop = Loop.objects.select_related("project").filter(id=loop_id, project_id=viewer.project_id).first()
    if loop is None:
        raise Http404("no such loop in this project")
    return loop


@page()
def loops(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    rows = [service.summary(x) for x in Loop.objects.filter(project_id=viewer.project_id)[:50]]
    policies = [service.policy_dict(p) for p in LoopPolicy.objects.filter(project_id=viewer.project_id)]
    return polled_page(request, viewer, "loops", template="dashboards/loops.html",
                       partial="dashboards/partials/loop_list.html",
                       active=any(r["state"] in ACTIVE_STATES for r in rows), reload_when_done=False, loops=rows,
                       policies=policies)


@page()
def loop_detail(request: HttpRequest, viewer: Viewer, loop_id: int) -> HttpResponse:
    loop = _loop(viewer, loop_id)
    return polled_page(request, viewer, "loops", template="dashboards/loop.html",
                       partial="dashboards/partials/loop_progress.html", active=loop.active, reload_when_done=True,
                       loop=service.summary(loop, detail=True))


@require_http_methods(["POST"])
@page()
def loop_control(request: HttpRequest, viewer: Viewer, loop_id: int, action: str) -> HttpResponse:
    if action not in CONTROLS:
        raise Http404("no such control")
    role, do = CONTROLS[action]
    viewer.require(role, f"{action} a loop")
    loop = _loop(viewer, loop_id)
    try:
        do(loop, viewer.identity.username)
    except service.LoopError as exc:
        return HttpResponse(str(exc), status=exc.status, content_type="text/plain; charset=utf-8")
    log.info("loop %s: %s from the dashboard by %s", loop.id, action, viewer.identity.username)
    return redirect(reverse("loop", args=[loop.id]))


@require_http_methods(["GET", "POST"])
@page()
def loop_approval(request: HttpRequest, viewer: Viewer, token: str) -> HttpResponse:
    """The link a notification carries: GET shows the loop and its proposal; an admin's POST decides."""
    try:
        loop = service.loop_of_token(token, set(viewer.identity.projects))
    except service.LoopError as exc:
        response = _approval_page(request, viewer, refused=str(exc))
        response.status_code = exc.status
        return response
    if request.method == "POST":
        viewer.require("admin", "deciding a loop's rollout")
        approve = request.POST.get("decision") == "approve"
        try:
            service.decide(loop, approve=approve, actor=viewer.identity.username,
                           reason=request.POST.get("reason", "")[:500])
        except service.LoopError as exc:
            return HttpResponse(str(exc), status=exc.status, content_type="text/plain; charset=utf-8")
        log.info("loop %s: %s through its link by %s", loop.id, "approved" if approve else "denied",
                 viewer.identity.username)
        return redirect(reverse("loop", args=[loop.id]))
    return _approval_page(request, viewer, loop=service.summary(loop, detail=True),
                          can_decide=viewer.identity.can(loop.project_id, "admin"))


def _approval_page(request: HttpRequest, viewer: Viewer, **context) -> HttpResponse:
    return polled_page(request, viewer, "loops", template="dashboards/loop_approval.html",
                       partial="dashboards/loop_approval.html", active=False, reload_when_done=False, **context)
