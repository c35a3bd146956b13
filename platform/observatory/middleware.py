"""Middleware of the JSON API's plumbing that django-ninja leaves to the project."""
from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse

_ORDER = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class ApiMethods:
    """Under /api/: HEAD is answered like GET (the server drops the body), and a method an endpoint does not take
    is a 405 in JSON, with its Allow header, like every other API error."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        api = request.path.startswith("/api/")
        if api and request.method == "HEAD":
            request.method = "GET"
        response = self.get_response(request)
        if api and response.status_code == 405 and not response.get("Content-Type", "").startswith("application/json"):
            methods = sorted({m.strip() for m in response.get("Allow", "").split(",") if m.strip()} - {"HEAD"},
                             key=lambda m: (_ORDER.index(m) if m in _ORDER else len(_ORDER), m))
            allowed = ", ".join(methods + (["HEAD"] if "GET" in methods else []))
            methods = ", ".join(methods) or "no method"
            replaced = HttpResponse(json.dumps({"error": f"method {request.method} not allowed; use {methods}"}),
                                    status=405, content_type="application/json")
            replaced["Allow"] = allowed
            return replaced
        return response
