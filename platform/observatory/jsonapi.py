"""The plumbing every JSON endpoint under /api/v1 shares: one view decorator and one reader of JSON bodies.

An endpoint is ``@json_view("GET", "POST")`` and takes ``(request, identity, *url_args)``: the decorator allows those
methods (and HEAD with GET), resolves the Bearer API token, and turns the endpoint's answer and its errors into JSON.
"""
from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from tenancy.keys import bearer_token, resolve_api_token
from traces.store import StoreUnavailable

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024


class ApiError(Exception):
    """An answer for the API user: ``{"error": message, **extra}`` with that status."""

    def __init__(self, status: int, message: str, **extra):
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


ErrorMap = Mapping[type[Exception], Callable[[Exception], ApiError]]


def json_view(*methods: str, errors: ErrorMap | None = None):
    """Bearer-token auth and JSON everywhere: every answer, errors included, is a JSON object (errors carry "error").

    The endpoint returns its body (200), ``(body, status)``, or None (204, no body). ApiError becomes its status;
    ``errors`` maps the endpoint's own exceptions to an ApiError; an unavailable trace store is 503 with
    Retry-After; anything else is logged and answered 500. A method not listed (HEAD comes with GET) is 405 with
    an Allow header. CSRF does not apply: the API authenticates with a header, never with a cookie.
    """
    allowed = tuple(methods) + (("HEAD",) if "GET" in methods and "HEAD" not in methods else ())
    translate = dict(errors or {})
    own_errors = tuple(translate)

    def decorate(fn):
        @functools.wraps(fn)
        @csrf_exempt
        def wrapper(request: HttpRequest, *args, **kwargs):
            if request.method not in allowed:
                response = JsonResponse({"error": f"method {request.method} not allowed; use {', '.join(methods)}"},
                                        status=405)
                response["Allow"] = ", ".join(allowed)
                return response
            try:
                try:
                    identity = resolve_api_token(bearer_token(request.META.get("HTTP_AUTHORIZATION")))
                    if identity is None:
                        raise ApiError(401, "missing or invalid API token (Authorization: Bearer <token>)")
                    result = fn(request, identity, *args, **kwargs)
                except own_errors as exc:
                    raise next(t(exc) for kind, t in translate.items() if isinstance(exc, kind)) from exc
                if result is None:
                    return HttpResponse(status=204)
                body, status = result if isinstance(result, tuple) else (result, 200)
                return JsonResponse(body, status=status)
            except ApiError as exc:
                return JsonResponse({"error": exc.message, **exc.extra}, status=exc.status)
            except StoreUnavailable:
                response = JsonResponse({"error": "the trace store is unavailable; retry shortly"}, status=503)
                response["Retry-After"] = "5"
                return response
            except Exception:
                log.exception("API request failed: %s %s", request.method, request.get_full_path())
                return JsonResponse({"error": "internal error"}, status=500)

        return wrapper

    return decorate


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def json_body(request: HttpRequest, hint: str = "") -> dict:
    """The request's body, which must be a JSON object in UTF-8 of at most MAX_BODY_BYTES; otherwise ApiError
    (413 when too large, 400 else). ``hint`` says what the object is, for the error messages."""
    suffix = f" ({hint})" if hint else ""
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > MAX_BODY_BYTES:  # refused before it is read
        raise ApiError(413, f"the body is limited to {MAX_BODY_BYTES} bytes")
    raw = request.body
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is limited to {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        raise ApiError(400, f"the body must be a JSON object{suffix}; it is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, f"the body must be a JSON object in UTF-8{suffix}") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise ApiError(400, f"the body must be a JSON object{suffix}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object{suffix}, not {_json_kind(data)}")
    return data


def _json_kind(value) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return "a number"
