"""Who is looking and at which project: the session's user, their memberships (the API's roles), the project chosen.

A page is a view wrapped in `page(role)`: a logged-out visitor goes to the login page, the project comes from
`?project=NAME` (remembered in the session) or the session, else the user's first project by name; a project
the user is not a member of answers 404 (as the API does), and a role below `role` answers 403. Within a page,
`viewer.require(role, doing)` refuses what needs more (a form's POST, a control) with 403 and that sentence, and
`form_post(role, doing)` is a page that a form posts to, refused so before anything else.
"""
from __future__ import annotations

import dataclasses
import functools

from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponseForbidden
from django.views.decorators.http import require_http_methods
from tenancy.keys import ApiIdentity
from tenancy.models import ROLE_RANK, Membership, Role

SESSION_PROJECT = "dashboard_project"


class Refused(Exception):
    """What the viewer's role does not allow: `page` answers it 403 with the message."""


@dataclasses.dataclass(frozen=True)
class Viewer:
    """The user of a page, in one project."""

    identity: ApiIdentity
    project_id: int
    project: str
    role: str

    def can(self, role: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(role)]

    def require(self, role: str, doing: str, verb: str = "needs") -> None:
        """Raise Refused, "<doing> needs the <role> role in project P", unless the viewer has `role` (`verb`
        "need" for a plural: "channels need ...")."""
        if not self.can(role):
            raise Refused(f"{doing} {verb} the {role} role in project {self.project}")

    @property
    def projects(self) -> list[str]:
        return sorted(self.identity.project_names)


def identity_of(user) -> ApiIdentity:
    """The user's projects and roles (their memberships), as the API's identity of a token without a cap."""
    projects: dict[int, str] = {}
    names: dict[str, int] = {}
    for membership in Membership.objects.filter(user_id=user.pk).select_related("project"):
        projects[membership.project_id] = membership.role
        names[membership.project.name] = membership.project_id
    return ApiIdentity(user.pk, user.get_username(), Role.ADMIN, projects, names)


def viewer_for(request: HttpRequest) -> Viewer:
    identity = identity_of(request.user)
    wanted = request.GET.get("project") or request.session.get(SESSION_PROJECT)
    if wanted is not None and wanted not in identity.project_names:
        if "project" in request.GET:
            raise Http404("no such project for this user")
        wanted = None
    if wanted is None:
        if not identity.project_names:
            raise Http404("this user is a member of no project")
        wanted = min(identity.project_names)
    if request.session.get(SESSION_PROJECT) != wanted:
        request.session[SESSION_PROJECT] = wanted
    project_id = identity.project_names[wanted]
    return Viewer(identity, project_id, wanted, identity.projects[project_id])


def page(role: str = Role.VIEWER):
    """Decorate a view(request, viewer, ...) with login, project choice and the role it needs; what the view
    refuses (Refused) answers 403."""

    def wrap(view):
        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args, **kwargs):
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            viewer = viewer_for(request)
            if not viewer.can(role):
                return HttpResponseForbidden(f"this needs the {role} role in project {viewer.project} "
                                             f"(you have {viewer.role})")
            try:
                return view(request, viewer, *args, **kwargs)
            except Refused as refusal:
                return HttpResponseForbidden(str(refusal))

        return wrapped

    return wrap


def form_post(role: str, doing: str, verb: str = "needs"):
    """Decorate a view(request, viewer, ...) that a form posts to: POST only (405 otherwise), a `page`, and the
    viewer refused first unless it has ``role`` (`Viewer.require(role, doing, verb)`)."""

    def wrap(view):
        @functools.wraps(view)
        def acting(request: HttpRequest, viewer: Viewer, *args, **kwargs):
            viewer.require(role, doing, verb)
            return view(request, viewer, *args, **kwargs)

        return require_http_methods(["POST"])(page()(acting))

    return wrap
