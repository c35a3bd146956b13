"""OpenAI-style error responses, the only error shape the gateway ever sends.

The body is ``{"error": {"message", "type", "param", "code"}}`` as in OpenAI's API (and
vLLM's ``ErrorResponse``), so OpenAI client libraries raise the matching exception class.
``code`` is a short, stable identifier clients and dashboards can match on.
"""
from __future__ import annotations

import orjson
from aiohttp import web

# OpenAI's ``type`` for each status the gateway produces itself.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


def error_payload(status: int, message: str, code: str, *, param: str | None = None) -> dict:
    """The JSON document of an OpenAI-style error."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_body(status: int, message: str, code: str, *, param: str | None = None) -> bytes:
    return orjson.dumps(error_payload(status, message, code, param=param))


def error_response(
    status: int,
    message: str,
    code: str,
    *,
    param: str | None = None,
    retry_after: float | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A JSON error response; ``retry_after`` (seconds, rounded up to ≥ 1) adds ``Retry-After``."""
    all_headers = {"Content-Type": "application/json"}
    if retry_after is not None:
        all_headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))
    all_headers.update(headers or {})
    return web.Response(status=status, body=error_body(status, message, code, param=param), headers=all_headers)


class GatewayError(Exception):
    """A failure the gateway answers itself, with an HTTP status and an OpenAI error code."""

    def __init__(self, status: int, message: str, code: str, *, retry_after: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
        self.param = param

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.code, param=self.param, retry_after=self.retry_after)
