"""OpenAPI paths and schemas of the alerts app, merged into /api/v1/openapi.json by observatory/openapi.py."""

_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {
    "400": {**_ERROR, "description": "invalid parameters or body, or several projects and no ?project="},
    "401": {**_ERROR, "description": "missing or invalid API token"},
    "403": {**_ERROR, "description": "the token has no project, or not the operator role it needs"},
    "404": {**_ERROR, "description": "no such project, alert or silence for this token"},
    "405": {**_ERROR, "description": "method not allowed"},
}
_PROJECT = {"name": "project", "in": "query", "required": False, "schema": {"type": "string"},
            "description": "Project name; required when the token can read several."}
_TIME = {"type": ["string", "null"], "format": "date-time"}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _json(schema: dict, description: str = "ok") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


SCHEMAS = {
    "Alert": {
        "type": "object",
        "properties": {
            "fingerprint": {"type": "string", "pattern": "^[0-9a-f]{64}$",
                            "description": "sha256 of project, kind, SLO id (or regression key) and severity"},
            "kind": {"enum": ["slo_burn", "latency_regression"]},
            "severity": {"enum": ["page", "ticket"]},
            "state": {"enum": ["pending", "firing", "resolved", "inactive"]},
            "project": {"type": "string"},
            "slo": {"type": ["string", "null"]},
            "episode": {"type": "integer"},
            "title": {"type": "string"},
            "labels": _STR_MAP,
            "annotations": _STR_MAP,
            "values": {"type": "object", "description": "the newest evaluation's figures (burn rates, budget, p50s)"},
            "started_at": _TIME, "fired_at": _TIME, "resolved_at": _TIME,
            "last_evaluated_at": _TIME, "last_notified_at": _TIME,
            "silenced_by": {"type": "array", "items": {"type": "integer"}},
            "inhibited_by": {"type": ["string", "null"]},
            "diagnosis": {"oneOf": [{"$ref": "#/components/schemas/Diagnosis"}, {"type": "null"}]},
            "transitions": {"type": "array", "items": {"$ref": "#/components/schemas/AlertTransition"},
                            "description": "only on GET /api/v1/alerts/{fingerprint}"},
        },
    },
    "AlertTransition": {
        "type": "object",
        "properties": {
            "from": {"type": ["string", "null"]}, "to": {"type": "string"}, "at": _TIME,
            "episode": {"type": "integer"}, "reason": {"type": "string"},
            "event_id": {"type": ["string", "null"], "description": "the notification event (unique)"},
            "notified": {"type": "boolean"},
            "muted": {"type": ["object", "null"], "description": '{"silences": [ids]} or {"inhibited_by": fp}'},
            "delivery_ids": {"type": "array", "items": {"type": "integer"}},
            "values": {"type": "object"},
        },
    },
    "Diagnosis": {
        "type": "object",
        "description": "docs/alerts.md#diagnosis",
        "properties": {
            "sli": {"type": "string"}, "threshold_ms": {"type": ["number", "null"]},
            "burning": {"type": "object"}, "baseline": {"type": "object"}, "baseline_usable": {"type": "boolean"},
            "components": {"type": "object", "description": "network, overhead, queue, prefill, decode: p50/mean/"
                                                            "share of e2e per window and their deltas"},
            "dominant_component": {"type": ["string", "null"]},
            "dominant_reason": {"type": "string"},
            "top_contributors": {"type": "array", "items": {"type": "object"}},
            "contributors": {"type": "object"},
            "suggestion": {"type": "string"},
            "suggestion_detail": {"type": "object"},
            "summary": {"type": "string"},
            "error": {"type": "string", "description": "set instead of the figures when the diagnosis failed"},
        },
    },
    "Matcher": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "op": {"enum": ["=", "!=", "=~", "!~"]}, "value": {"type": "string"}},
        "required": ["name", "value"],
    },
    "Silence": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"}, "project": {"type": "string"},
            "matchers": {"type": "array", "items": {"$ref": "#/components/schemas/Matcher"}},
            "starts_at": _TIME, "ends_at": _TIME, "status": {"enum": ["pending", "active", "expired"]},
            "created_by": {"type": "string"}, "comment": {"type": "string"}, "created_at": _TIME,
            "expired_at": _TIME, "expired_by": {"type": ["string", "null"]},
        },
    },
}

PATHS = {
    "/api/v1/alerts": {
        "get": {
            "summary": "The project's alerts (firing first) with their labels, timestamps and diagnosis",
            "parameters": [
                {"name": "state", "in": "query", "schema": {"type": "string"},
                 "description": "comma-separated subset of pending, firing, resolved, inactive"},
                {"name": "severity", "in": "query", "schema": {"type": "string"}, "description": "page and/or ticket"},
                {"name": "slo", "in": "query", "schema": {"type": "string"}, "description": "SLO name"},
                {"name": "kind", "in": "query", "schema": {"type": "string"},
                 "description": "slo_burn and/or latency_regression"},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
                _PROJECT,
            ],
            "responses": {"200": _json({"type": "object", "properties": {
                "alerts": {"type": "array", "items": {"$ref": "#/components/schemas/Alert"}}}}), **_ERRORS},
        }
    },
    "/api/v1/alerts/{fingerprint}": {
        "get": {
            "summary": "One alert with its transitions (and repeat notifications)",
            "parameters": [{"name": "fingerprint", "in": "path", "required": True, "schema": {"type": "string"}},
                           _PROJECT],
            "responses": {"200": _json({"type": "object", "properties": {
                "alert": {"$ref": "#/components/schemas/Alert"}}}), **_ERRORS},
        }
    },
    "/api/v1/silences": {
        "get": {
            "summary": "The project's silences, newest first",
            "parameters": [{"name": "status", "in": "query", "schema": {"type": "string"},
                            "description": "comma-separated subset of active, pending, expired"},
                           {"name": "limit", "in": "query", "schema": {"type": "integer"}}, _PROJECT],
            "responses": {"200": _json({"type": "object", "properties": {
                "silences": {"type": "array", "items": {"$ref": "#/components/schemas/Silence"}}}}), **_ERRORS},
        },
        "post": {
            "summary": "Create a silence (operator role): matching alerts change state but send nothing",
            "parameters": [_PROJECT],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object",
                "properties": {
                    "matchers": {"type": "array", "items": {"oneOf": [
                        {"$ref": "#/components/schemas/Matcher"},
                        {"type": "string", "description": 'name="value", name!=value, name=~regex, name!~regex'}]}},
                    "starts_at": {"type": "string", "format": "date-time", "description": "default now"},
                    "ends_at": {"type": "string", "format": "date-time"},
                    "duration": {"type": ["string", "number"], "description": "instead of ends_at: 30m, 2h, 1d or "
                                                                              "seconds"},
                    "comment": {"type": "string"},
                    "project": {"type": "string"},
                },
                "required": ["matchers", "comment"],
            }}}},
            "responses": {"201": _json({"type": "object", "properties": {
                "silence": {"$ref": "#/components/schemas/Silence"},
                "silences_alerts": {"type": "array", "items": {"type": "string"},
                                    "description": "fingerprints of pending/firing alerts it matches now"}}},
                "created"), **_ERRORS},
        },
    },
    "/api/v1/silences/{id}": {
        "get": {
            "summary": "One silence",
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "integer"}}],
            "responses": {"200": _json({"type": "object", "properties": {
                "silence": {"$ref": "#/components/schemas/Silence"}}}), **_ERRORS},
        },
        "delete": {
            "summary": "Expire a silence now (operator role)",
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "integer"}}],
            "responses": {"200": _json({"type": "object", "properties": {
                "silence": {"$ref": "#/components/schemas/Silence"}}}), **_ERRORS},
        },
    },
}
