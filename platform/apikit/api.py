"""The JSON API at /api/v1: one django-ninja application whose routers live in their apps (traces, slo, alerts,
notify, observatory's engine view). Every parameter and body is parsed by declared pydantic types
(apikit.inputs), and the OpenAPI document at /api/v1/openapi.json is generated from the same declarations.

Why django-ninja: it is pydantic v2 under Django views, so a declaration is at once the parser, the 400 that
names the field, and the schema; writing our own decorator over pydantic would repeat what it does (the
hand-written document this replaces had drifted from the views: 12 of 19 operations rejected most of what it
allowed).

Errors are JSON objects with "error" (a sentence) everywhere, as before: 400 for input that fails its
declaration (with "problems": [{"field", "in", "reason"}]) or the domain's rules, 401/403/404/405/409/413/429,
503 with Retry-After when the trace store is away, 500 ("internal error", logged) for the rest.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from ninja import NinjaAPI, Router, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.operation import Operation
from ninja.parser import Parser
from ninja.responses import Status
from ninja.security import HttpBearer
from tenancy import throttle
from tenancy.keys import ApiIdentity, TokenExpired, bearer_token, resolve_api_token
from tenancy.models import Project

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024


class ApiError(Exception):
    """An answer for the API user: ``{"error": message, **extra}`` with that status."""

    def __init__(self, status: int, message: str, **extra):
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


class Error(Schema):
    error: str


class Problem(Schema):
    field: str
    # where the field is: query, path, body
    location: str
    reason: str


class InvalidInput(Schema):
    error: str
    problems: list[Problem] = []


_ERROR_TEXT = {
    400: "invalid input: the parameter or body field named in `error` (and `problems`) is wrong",
    401: "missing, invalid or expired API token",
    403: "the token lacks the role this needs in the project",
    404: "no such object for this token (or no such project: other projects' objects are not revealed)",
    409: "the name is taken in this project",
    413: "the body is larger than 64 KiB",
    429: "a bad token from an address that failed too often (Retry-After); valid tokens are never refused",
    503: "the trace store is unavailable (Retry-After)",
}


def errors(*codes: int) -> dict[int, Any]:
    """Response declarations for these error statuses (401 and 429 are added to every authenticated
    operation by `api`)."""
    return {code: (InvalidInput if code == 400 else Error) for code in codes}


def answer(result: Any) -> HttpResponseBase:
    """A view's result as the response: its JSON as it is (orjson), with the status of a `Status`."""
    if isinstance(result, HttpResponseBase):
        return result
    status = 200
    if isinstance(result, Status):
        status, result = result.status_code, result.value
    if status == 204:
        return HttpResponse(status=204)
    return HttpResponse(orjson.dumps(result), status=status, content_type="application/json")


class AnsweredOperation(Operation):
    """An operation whose result goes out as it is (`answer`), its declared models making the document only."""

    def _result_to_response(self, request, result, temporal_response):
        return answer(result)


class ApiRouter(Router):
    """A router whose declared answers are the document's, not a second pass over each answer.

    The views return JSON-ready objects under their public names (an optional field they leave out is left
    out, not null: e.g. an alert's transitions outside its own page). django-ninja would validate every answer
    against its declared model and dump it again, a third of the time of a small read (apikit.bench);
    the tests hold the answers to the document instead (schemathesis' response_schema_conformance on every
    operation, tests/observatory/test_api_fuzz.py)."""

    def add_api_operation(self, path, methods, view_func, **kwargs):
        kwargs["by_alias"] = True
        kwargs["exclude_unset"] = True
        super().add_api_operation(path, methods, view_func, **kwargs)
        for operation in self.path_operations[path].operations:
            if operation.view_func is view_func and type(operation) is Operation:
                operation.__class__ = AnsweredOperation


class ApiTokenAuth(HttpBearer):
    """Authorization: Bearer <API token>. A valid token is always let in. Failed attempts are counted per client
    address, and beyond the limit a bad token from that address gets 429 with Retry-After instead of 401
    (tenancy.throttle): the throttle bounds what bad attempts cost, it never locks out the address's valid users
    (a shared NAT, a proxy without OBSERVATORY_TRUSTED_PROXIES)."""

    def __call__(self, request: HttpRequest) -> ApiIdentity:
        # HttpBearer's own __call__ answers None to a missing or malformed header; here that is a failure counted
        # against the address like a wrong token.
        return self.authenticate(request, bearer_token(request.headers.get("Authorization")))

    def authenticate(self, request: HttpRequest, token: str | None) -> ApiIdentity:
        try:
            identity = resolve_api_token(token)
            refusal = "missing or invalid API token (Authorization: Bearer <token>)"
        except TokenExpired as exc:
            identity, refusal = None, str(exc)
        if identity is not None:
            return identity
        address = throttle.client_address(request)
        wait = throttle.api_blocked_for(address)
        if wait:
            raise ApiError(429, f"too many failed authentications from {address}; retry in {wait} s",
                           retry_after=wait)
        throttle.api_failure(address)
        raise ApiError(401, refusal)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class StrictJsonParser(Parser):
    """Bodies are JSON objects in UTF-8 of at most 64 KiB, without NaN/Infinity."""

    def parse_body(self, request: HttpRequest) -> dict:
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        if declared > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is limited to {MAX_BODY_BYTES} bytes")
        raw = request.body
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is limited to {MAX_BODY_BYTES} bytes")
        if not raw.strip():
            raise ApiError(400, "the body must be a JSON object; it is empty")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except UnicodeDecodeError:
            raise ApiError(400, "the body must be a JSON object in UTF-8") from None
        except (ValueError, RecursionError):
            raise ApiError(400, "the body must be a JSON object") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the body must be a JSON object, not {_json_kind(data)}")
        return data


def _json_kind(value) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else "a number"


api = NinjaAPI(
    title="LLM latency observatory API",
    version="1",
    description=(
        "Per-request latency decomposition (network / overhead / queue / prefill / decode) of LLM calls, SLOs, "
        "alerts, silences and notification channels. Every operation takes an API token "
        "(`Authorization: Bearer <token>`, from `manage.py create_api_token`). A token reads the projects its "
        "user belongs to, with the lower of its own role and the membership's: viewers read, operators manage "
        "SLOs and silences, admins manage channels. Objects of other projects answer 404."
    ),
    openapi_url="/openapi.json",
    docs_url=None,
    auth=ApiTokenAuth(),
    parser=StrictJsonParser(),
    urls_namespace="api-v1",
)


@api.exception_handler(ApiError)
def error_response(request: HttpRequest, exc: ApiError) -> HttpResponse:
    """The answer to an ApiError: {"error", **extra}, with Retry-After on 429 and 503."""
    extra = dict(exc.extra)
    retry_after = extra.pop("retry_after", None)
    response = JsonResponse({"error": exc.message, **extra}, status=exc.status)
    if exc.status in (429, 503):
        response["Retry-After"] = str(retry_after or 5)
    return response


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    problems = problems_of(exc.errors)
    text = "; ".join(f"{p['field']}: {p['reason']}" for p in problems) or "invalid input"
    return JsonResponse({"error": text, "problems": problems}, status=400)


def problems_of(errors: list[dict]) -> list[dict]:
    """pydantic's errors as one problem per field: a value that fits none of a union's forms reports each
    form's reason, joined with "or"."""
    merged: dict[tuple[str, str], list[str]] = {}
    for error in errors:
        found = problem(error)
        reasons = merged.setdefault((found["field"], found["location"]), [])
        if found["reason"] not in reasons:
            reasons.append(found["reason"])
    return [{"field": field, "location": location, "reason": " or: ".join(reasons)}
            for (field, location), reasons in merged.items()]


# pydantic's generic wording, said plainly (the message of our own validators is kept as it is).
_REASONS = {
    "missing": "required",
    "none_required": "not allowed here: leave it out (or null)",
    "extra_forbidden": "unknown field",
    "string_unicode": "text must be valid Unicode (it holds a lone surrogate)",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


# The values of the discriminators of the API's tagged unions (e.g. an SLO's "sli"): pydantic puts the tag in an
# error's location, where it is not a field. The schemas that declare such unions add their tags.
union_tags: set[str] = set()


def _is_union_tag(part: str) -> bool:
    """The names pydantic puts in an error's location for the form of a union it tried (not a field)."""
    return any(c in part for c in "[(<") or part in ("str", "int", "float", "bool", "list", "dict") \
        or part[:1].isupper() or part.startswith("constrained-") or part in union_tags


def problem(error: dict) -> dict:
    """A pydantic error as {"field", "location", "reason"}: `field` is the dotted path within its location."""
    loc = [str(part) for part in error.get("loc", ())]
    location = loc[0] if loc else ""
    path = loc[1:] if location in ("query", "path", "body", "header") else loc
    if location == "body" and path[:1] == ["body"]:
        path = path[1:]
    tags = [part for part in path if part in union_tags]  # the form of a tagged union, e.g. an SLO's sli
    path = [part for part in path if not _is_union_tag(part)]
    kind = error.get("type", "")
    if kind == "missing" and location == "body" and not path:  # no body at all
        return {"field": "body", "location": "body", "reason": "the body must be a JSON object; it is empty"}
    reason = str(error.get("msg", "invalid"))
    if reason.startswith("Value error, "):
        reason = reason[len("Value error, "):]
    elif kind in _REASONS:
        reason = _REASONS[kind]
        if tags and kind in ("missing", "none_required", "extra_forbidden"):
            reason = {"missing": f"required with {tags[-1]}", "none_required": f"not allowed with {tags[-1]}",
                      "extra_forbidden": f"not a field of {tags[-1]}"}[kind]
    elif kind in ("too_short", "too_long") and "List" in reason:
        bound = (error.get("ctx") or {}).get("min_length" if kind == "too_short" else "max_length")
        reason = f"a list of {'at least' if kind == 'too_short' else 'at most'} {bound} item(s)"
    elif kind in ("union_tag_invalid", "union_tag_not_found"):  # the discriminator itself: missing or unknown
        ctx = error.get("ctx") or {}
        path = [*path, str(ctx.get("discriminator", "")).strip("'")]
        reason = "required" if kind == "union_tag_not_found" else f"one of {ctx.get('expected_tags', '')}"
    elif kind == "literal_error":
        reason = "one of " + str((error.get("ctx") or {}).get("expected", "the values listed in the API document"))
    return {"field": ".".join(path) or location, "location": location, "reason": reason}


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return JsonResponse({"error": "missing or invalid API token (Authorization: Bearer <token>)"}, status=401)


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if isinstance(exc.__cause__, ApiError):  # ninja wraps what the body parser raised
        return error_response(request, exc.__cause__)
    return JsonResponse({"error": str(exc)}, status=exc.status_code)


@api.exception_handler(Exception)
def _internal(request: HttpRequest, exc: Exception) -> HttpResponse:
    log.exception("API request failed: %s %s", request.method, request.get_full_path(), exc_info=exc)
    return JsonResponse({"error": "internal error"}, status=500)


def project_for(identity: ApiIdentity, name: str | None) -> int:
    """The project named by ?project= (or a body's "project"), or the token's only project."""
    if name is None:
        if len(identity.projects) == 1:
            return next(iter(identity.projects))
        if not identity.projects:
            raise ApiError(403, "this token has no project")
        raise ApiError(400, "this token can read several projects: pass ?project=NAME")
    project_id = identity.project_names.get(name)
    if project_id is None:
        raise ApiError(404, f"no project named {name!r} for this token")
    return project_id


def project_object(identity, name: str | None) -> Project:
    """The Project row project_for() names, for views that filter or create objects by it."""
    return Project.objects.get(id=project_for(identity, name))


def project_name(identity: ApiIdentity, project_id: int) -> str:
    return next(name for name, pid in identity.project_names.items() if pid == project_id)


def require(identity: ApiIdentity, project_id: int, role: str, what: str = "that") -> None:
    if not identity.can(project_id, role):
        raise ApiError(403, f"this token needs the {role} role in project {project_name(identity, project_id)} "
                            f"for {what} (it has {identity.role_in(project_id)})")


def acting_in(request: HttpRequest, name: str | None, role: str, doing: str) -> tuple[ApiIdentity, Project]:
    """The request's token and the Project row project_object() names, once the token is found to have ``role``
    there for ``doing`` (403 otherwise): the start of an operation that changes the project's objects."""
    identity = request.auth
    project = project_object(identity, name)
    require(identity, project.id, role, doing)
    return identity, project


def refused(exc: Exception) -> ApiError:
    """A service's refusal (RunError, StudyError, RolloutError: a message, its `problems`, the `field` they are
    about, maybe an HTTP `status`) as the API's answer: that status (else 400), each problem under its body field
    (else "body")."""
    return ApiError(getattr(exc, "status", 400), str(exc),
                    problems=[{"field": exc.field or "body", "location": "body", "reason": problem}
                              for problem in exc.problems])


PROJECT_DESCRIPTION = ("Project name. Required when the token reads several projects; a token of one project "
                       "may leave it out. A project the token does not read is 404.")


def declared(*codes: int, ok: dict[int, Any] | None = None) -> dict[int, Any]:
    """Responses of an authenticated operation: `ok` (status → schema) plus errors for `codes` and the
    errors every such operation can give (400, 401, 403 and 404 through the project, 429, 503)."""
    out = dict(ok or {})
    out.update(errors(400, 401, 403, 404, 429, 503, *codes))
    return out


def paths(routers: Iterable[tuple[str, Any]]) -> None:
    for prefix, router in routers:
        api.add_router(prefix, router)


def unavailable(exception: type[Exception], message: str) -> None:
    """Answer ``exception`` with 503, Retry-After and ``message`` wherever an operation raises it (the shell says
    which: the trace store's StoreUnavailable)."""

    @api.exception_handler(exception)
    def _away(request: HttpRequest, exc: Exception) -> HttpResponse:
        return error_response(request, ApiError(503, message))
