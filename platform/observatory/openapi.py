"""The OpenAPI 3.1 document of the JSON API, served at /api/v1/openapi.json."""

_NUM = {"type": ["number", "null"]}
_TAIL = {"type": "object", "properties": {"p50": _NUM, "p95": _NUM, "p99": _NUM}}
_COMPONENT = {"type": "object", "properties": {"p50": _NUM, "p95": _NUM}}
_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
# Every error the API answers, always a JSON object with "error".
_ERRORS = {
    "400": {**_ERROR, "description": "invalid parameters, or the token reads several projects and no ?project= was given"},
    "401": {**_ERROR, "description": "missing or invalid API token"},
    "403": {**_ERROR, "description": "the token has no project"},
    "404": {**_ERROR, "description": "no such project for this token"},
    "405": {**_ERROR, "description": "method other than GET or HEAD"},
    "503": {**_ERROR, "description": "the trace store is unavailable (Retry-After)"},
}
_PROJECT = {
    "name": "project", "in": "query", "required": False, "schema": {"type": "string"},
    "description": "Project name; required when the token can read several projects.",
}

OPENAPI = {
    "openapi": "3.1.0",
    "info": {
        "title": "LLM latency observatory API",
        "version": "1",
        "description": "Per-request latency decomposition (network / overhead / queue / prefill / decode) of LLM calls.",
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "API token (create_api_token)"}},
        "schemas": {
            "Error": {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]},
            "Hop": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["client", "gateway", "engine"]},
                    "span_id": {"type": "string"}, "service": {"type": "string"}, "convention": {"type": "string"},
                    "name": {"type": "string"}, "start_ns": {"type": "integer"}, "duration_ms": {"type": "number"},
                    "ttft_ms": _NUM,
                },
            },
            "Request": {
                "type": "object",
                "properties": {
                    "trace_id": {"type": "string"}, "request_key": {"type": "string"}, "request_id": {"type": "string"},
                    "start_time": {"type": "string", "format": "date-time"}, "service": {"type": "string"},
                    "model": {"type": "string"}, "engine_config": {"type": "string"},
                    "replica_group": {"type": "string", "description": "'' when the engine did not say"},
                    "prompt_tokens": {"type": ["integer", "null"]}, "completion_tokens": {"type": ["integer", "null"]},
                    "prompt_bucket": {"type": "string"},
                    **{name: _NUM for name in (
                        "e2e_ms", "ttft_ms", "engine_ttft_ms", "tpot_ms", "network_ms", "overhead_ms", "queue_ms",
                        "prefill_ms", "decode_ms")},
                    "network_ms_per_hop": {
                        "type": "object", "properties": {"client_gateway": _NUM, "gateway_engine": _NUM},
                    },
                    "hops": {"type": "array", "items": {"$ref": "#/components/schemas/Hop"}},
                    "status": {"enum": ["ok", "error"]},
                },
            },
            "SummaryGroup": {
                "type": "object",
                "properties": {
                    "key": {"type": "object", "additionalProperties": {"type": "string"}},
                    "count": {"type": "integer"}, "errors": {"type": "integer"},
                    "e2e_ms": _TAIL, "ttft_ms": _TAIL, "tpot_ms": _TAIL,
                    **{name: _COMPONENT for name in ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")},
                },
            },
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/api/v1/requests": {
            "get": {
                "summary": "LLM requests of one trace, with their latency decomposition",
                "parameters": [
                    {"name": "trace_id", "in": "query", "required": True,
                     "schema": {"type": "string", "pattern": "^[0-9a-fA-F]{32}$"}},
                    _PROJECT,
                ],
                "responses": {
                    "200": {"description": "requests", "content": {"application/json": {"schema": {
                        "type": "object",
                        "properties": {"requests": {"type": "array", "items": {"$ref": "#/components/schemas/Request"}}},
                    }}}},
                    **_ERRORS,
                },
            }
        },
        "/api/v1/engine": {
            "get": {
                "summary": "The managed engine fleet: gateway, replica groups, weights, config versions, replica states",
                "description": "What the fleet controller reports (`manage.py engine status --json`); "
                               "`running` is false, with the last recorded state, when no controller answers.",
                "responses": {
                    "200": {"description": "fleet state", "content": {"application/json": {"schema": {
                        "type": "object",
                        "properties": {
                            "running": {"type": "boolean"},
                            "fleet": {"type": ["object", "null"]},
                            "last_state": {"type": ["object", "null"]},
                        },
                    }}}},
                    **_ERRORS,
                },
            }
        },
        "/api/v1/latency/summary": {
            "get": {
                "summary": "Latency percentiles per group over a time range",
                "parameters": [
                    {"name": "since", "in": "query", "schema": {"type": "string", "format": "date-time"},
                     "description": "default: until − 1 hour"},
                    {"name": "until", "in": "query", "schema": {"type": "string", "format": "date-time"},
                     "description": "default: now"},
                    {"name": "group_by", "in": "query", "schema": {"type": "string"},
                     "description": "comma-separated subset of model, service, prompt_bucket, engine_config, "
                                    "replica_group"},
                    {"name": "model", "in": "query", "schema": {"type": "string"}},
                    {"name": "service", "in": "query", "schema": {"type": "string"}},
                    {"name": "engine_config", "in": "query", "schema": {"type": "string"}},
                    {"name": "prompt_bucket", "in": "query", "schema": {"type": "string"}},
                    {"name": "replica_group", "in": "query", "schema": {"type": "string"}},
                    {"name": "exact", "in": "query", "schema": {"type": "boolean"},
                     "description": "exact percentiles instead of t-digest (slower)"},
                    _PROJECT,
                ],
                "responses": {
                    "200": {"description": "summary", "content": {"application/json": {"schema": {
                        "type": "object",
                        "properties": {
                            "since": {"type": "string"}, "until": {"type": "string"},
                            "group_by": {"type": "array", "items": {"type": "string"}},
                            "filters": {"type": "object", "additionalProperties": {"type": "string"},
                                        "description": "the filters applied (model, service, engine_config, "
                                                       "prompt_bucket, replica_group)"},
                            "quantiles": {"type": "object", "properties": {
                                "method": {"enum": ["exact", "t-digest"]}, "error": {"type": "string"}}},
                            "groups": {"type": "array", "items": {"$ref": "#/components/schemas/SummaryGroup"}},
                        },
                    }}}},
                    **_ERRORS,
                },
            }
        },
    },
}


def _merge_app_documents() -> None:
    """Each API app describes its own paths and schemas (``<app>/openapi.py``); one document serves them all."""
    from alerts import openapi as alerts_openapi
    from notify import openapi as notify_openapi
    from slo import openapi as slo_openapi

    for module in (slo_openapi, alerts_openapi, notify_openapi):
        OPENAPI["paths"].update(module.PATHS)
        OPENAPI["components"]["schemas"].update(module.SCHEMAS)


_merge_app_documents()
