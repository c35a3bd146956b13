"""OpenAPI paths and schemas of the slo app, merged into /api/v1/openapi.json by observatory/openapi.py."""
from .definitions import FILTER_DIMENSIONS

_NUM = {"type": ["number", "null"]}
_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {
    "400": {**_ERROR, "description": "invalid parameters or SLO definition (`problems` lists every one)"},
    "401": {**_ERROR, "description": "missing or invalid API token"},
    "403": {**_ERROR, "description": "the token has no project, or not the operator role for a change"},
    "404": {**_ERROR, "description": "no such project or SLO for this token"},
    "405": {**_ERROR, "description": "method not allowed"},
}
_PROJECT = {"name": "project", "in": "query", "required": False, "schema": {"type": "string"},
            "description": "Project name; required when the token can read several projects."}
_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]*$"}}
_SLO_RESPONSE = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Slo"}}}}
_DEFINITION_BODY = {"required": True, "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/SloDefinition"}}}}

_TIER = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "severity": {"enum": ["page", "ticket"]},
        "long_window": {"type": "string", "examples": ["1h"]}, "short_window": {"type": "string", "examples": ["5m"]},
        "factor": {"type": "number"},
    },
    "required": ["name", "severity", "long_window", "short_window", "factor"],
}
_FILTER = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

SCHEMAS: dict = {
    "SloDefinition": {
        "type": "object",
        "description": "The same fields as one item of `slos:` in the YAML format (docs/slo.md).",
        "properties": {
            "project": {"type": "string", "description": "optional; the same as ?project="},
            "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,99}$"},
            "description": {"type": "string"},
            "sli": {"enum": ["ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "error_ratio"]},
            "threshold_ms": {"type": "number", "description": "latency SLIs: a request is good at or under it"},
            "objective": {"oneOf": [{"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                    {"type": "string", "examples": ["99.9%"]}]},
            "period": {"enum": ["28d", "30d", 28, 30], "default": "30d"},
            "filters": {"type": "object", "properties": {k: _FILTER for k in FILTER_DIMENSIONS},
                        "additionalProperties": False},
            "tiers": {"oneOf": [{"const": "default"}, {"type": "array", "items": _TIER, "minItems": 1, "maxItems": 8}],
                      "default": "default"},
            "min_requests": {"type": "integer", "minimum": 0, "default": 20},
            "min_bad": {"type": "integer", "minimum": 0, "default": 3},
            "no_data": {"enum": ["ok", "keep", "alert"], "default": "ok"},
            "repeat_interval": {"oneOf": [{"type": "string", "examples": ["4h"]}, {"type": "integer"}],
                                "default": "4h"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "enabled": {"type": "boolean", "default": True},
        },
        "required": ["name", "sli", "objective"],
    },
    "SloTierStatus": {
        "type": "object",
        "properties": {**_TIER["properties"], "long_burn": _NUM, "short_burn": _NUM, "burning": {"type": "boolean"},
                       "suppressed": {"type": "boolean"}, "reason": {"type": "string"}},
    },
    "SloStatus": {
        "type": "object",
        "properties": {
            "state": {"enum": ["pending", "ok", "burning", "no_data", "low_traffic"]},
            "last_evaluated_at": {"type": ["string", "null"], "format": "date-time"},
            "firing": {"oneOf": [{"$ref": "#/components/schemas/SloTierStatus"}, {"type": "null"}]},
            "burn_rates": {"type": "object", "additionalProperties": _NUM,
                           "description": "window (5m, 30m, 1h, 2h, 6h, 1d, 3d, the period) → burn rate"},
            "budget_remaining": {**_NUM, "description": "over the period: 1 untouched, 0 spent, < 0 overspent"},
            "counts": {"type": "object", "additionalProperties": {
                "type": "object", "properties": {"total": {"type": "integer"}, "bad": {"type": "integer"}}}},
            "tiers": {"type": "array", "items": {"$ref": "#/components/schemas/SloTierStatus"}},
        },
    },
    "Slo": {
        "type": "object",
        "properties": {
            **{
                "project": {"type": "string"}, "name": {"type": "string"}, "description": {"type": "string"},
                "sli": {"type": "string"}, "threshold_ms": _NUM, "objective": {"type": "number"},
                "objective_percent": {"type": "string"}, "period": {"type": "string"},
                "period_days": {"type": "integer"}, "filters": {"type": "object"},
                "tiers": {"type": "array", "items": _TIER}, "default_tiers": {"type": "boolean"},
                "error_budget": {"type": "number"}, "min_requests": {"type": "integer"},
                "min_bad": {"type": "integer"}, "no_data": {"type": "string"},
                "repeat_interval": {"type": ["string", "integer"]}, "repeat_interval_seconds": {"type": "integer"},
                "labels": {"type": "object"}, "enabled": {"type": "boolean"},
                "created_at": {"type": "string", "format": "date-time"},
                "updated_at": {"type": "string", "format": "date-time"},
            },
            "status": {"$ref": "#/components/schemas/SloStatus"},
            "series": {"type": "array", "items": {"$ref": "#/components/schemas/SloStatusPoint"},
                       "description": "only with ?series=WINDOW"},
        },
    },
    "SloStatusPoint": {
        "type": "object",
        "properties": {
            "at": {"type": "string", "format": "date-time"},
            "state": {"type": "string"}, "firing_tier": {"type": ["string", "null"]},
            "severity": {"type": ["string", "null"]}, "budget_remaining": _NUM,
            "burn_rates": {"type": "object", "additionalProperties": {"type": "number"}},
            "counts": {"type": "object"},
        },
    },
}

PATHS: dict = {
    "/api/v1/slos": {
        "get": {
            "summary": "The project's SLOs with their latest evaluation (burn rate per window, budget remaining, state)",
            "parameters": [_PROJECT],
            "responses": {"200": {"description": "SLOs", "content": {"application/json": {"schema": {
                "type": "object", "properties": {
                    "project": {"type": "string"},
                    "slos": {"type": "array", "items": {"$ref": "#/components/schemas/Slo"}}}}}}},
                **_ERRORS},
        },
        "post": {
            "summary": "Create an SLO (operator)",
            "parameters": [_PROJECT],
            "requestBody": _DEFINITION_BODY,
            "responses": {"201": {"description": "created", **_SLO_RESPONSE},
                          "409": {**_ERROR, "description": "an SLO with this name exists"},
                          "413": {**_ERROR, "description": "body over 64 KiB"}, **_ERRORS},
        },
    },
    "/api/v1/slos/{name}": {
        "get": {
            "summary": "One SLO; ?series=WINDOW adds its status points over the last WINDOW (e.g. 6h, at most 90d)",
            "parameters": [_NAME, _PROJECT, {"name": "series", "in": "query", "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the SLO", **_SLO_RESPONSE}, **_ERRORS,
                          "503": {**_ERROR, "description": "the trace store is unavailable (series only)"}},
        },
        "put": {
            "summary": "Replace an SLO's definition (operator); fields left out take their defaults",
            "parameters": [_NAME, _PROJECT],
            "requestBody": _DEFINITION_BODY,
            "responses": {"200": {"description": "the SLO", **_SLO_RESPONSE},
                          "409": {**_ERROR, "description": "renamed onto an existing SLO"}, **_ERRORS},
        },
        "delete": {
            "summary": "Delete an SLO (operator)",
            "parameters": [_NAME, _PROJECT],
            "responses": {"200": {"description": "deleted", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"deleted": {"type": "string"}, "project": {"type": "string"}}}}}},
                **_ERRORS},
        },
    },
    "/api/v1/slos/{name}/history": {
        "get": {
            "summary": "The SLO's status series (one point per evaluation: state, budget remaining, burn rates, counts)",
            "parameters": [
                _NAME, _PROJECT,
                {"name": "since", "in": "query", "schema": {"type": "string", "format": "date-time"},
                 "description": "default: until − 24 h"},
                {"name": "until", "in": "query", "schema": {"type": "string", "format": "date-time"},
                 "description": "default: now; at most 90 days after since"},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000,
                                                            "default": 1440},
                 "description": "the newest points kept, returned oldest first"},
            ],
            "responses": {"200": {"description": "points", "content": {"application/json": {"schema": {
                "type": "object", "properties": {
                    "project": {"type": "string"}, "slo": {"type": "string"}, "since": {"type": "string"},
                    "until": {"type": "string"},
                    "points": {"type": "array", "items": {"$ref": "#/components/schemas/SloStatusPoint"}}}}}}},
                **_ERRORS, "503": {**_ERROR, "description": "the trace store is unavailable"}},
        },
    },
}
