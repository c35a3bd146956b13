"""OpenAPI paths and schemas of the notify app, merged into /api/v1/openapi.json by observatory/openapi.py."""

_ERR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {
    "400": {**_ERR, "description": "invalid body or parameters (the message says which field and why)"},
    "401": {**_ERR, "description": "missing or invalid API token"},
    "403": {**_ERR, "description": "the token's role in the project is too low (admins manage channels)"},
    "404": {**_ERR, "description": "no such channel or project for this token"},
    "405": {**_ERR, "description": "method not allowed"},
}
_PROJECT = {"name": "project", "in": "query", "required": False, "schema": {"type": "string"},
            "description": "Project name; required when the token can read several projects."}
_ID = {"name": "channel_id", "in": "path", "required": True, "schema": {"type": "integer"}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_STR_OR_NULL = {"type": ["string", "null"]}
_MATCHER = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "op": {"enum": ["=", "!=", "=~", "!~"]}, "value": {"type": "string"}},
    "required": ["name", "value"],
}
_CHANNEL_FIELDS = {
    "name": {"type": "string", "maxLength": 100},
    "url": {"type": "string", "description": "http(s) URL; checked against the SSRF rules (docs/notify.md). "
                                             "pagerduty defaults to https://events.pagerduty.com/v2/enqueue"},
    "severities": {"type": "array", "items": {"enum": ["page", "ticket"]}, "description": "empty = all"},
    "matchers": {"type": "array", "items": {"oneOf": [_MATCHER, {"type": "string", "description": 'name=~"regex"'}]}},
    "send_resolved": {"type": "boolean", "default": True},
    "enabled": {"type": "boolean"},
    "secrets": {"type": "array", "items": {"type": "string", "pattern": "^whsec_"}, "maxItems": 5,
                "description": "webhook/alertmanager: signing secrets; one is generated when omitted"},
    "routing_key": {"type": "string", "description": "pagerduty: the integration key (required)"},
}

SCHEMAS: dict = {
    "Channel": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"}, "project": {"type": "string"}, "name": {"type": "string"},
            "kind": {"enum": ["webhook", "alertmanager", "slack", "pagerduty"]},
            "url": {"type": "string", "description": "redacted: no password, no query values, no Slack path"},
            "enabled": {"type": "boolean"}, "disabled_reason": _STR_OR_NULL,
            "severities": _CHANNEL_FIELDS["severities"], "matchers": {"type": "array", "items": _MATCHER},
            "send_resolved": {"type": "boolean"},
            "secret_hints": {"type": "array", "items": {"type": "string"},
                             "description": "the first characters of each signing secret; secrets are shown once"},
            "routing_key_hint": _STR_OR_NULL,
            "last_error": _STR_OR_NULL, "last_error_at": _STR_OR_NULL, "last_success_at": _STR_OR_NULL,
            "created_at": {"type": "string", "format": "date-time"},
            "updated_at": {"type": "string", "format": "date-time"},
        },
    },
    "ChannelCreate": {
        "type": "object",
        "properties": {"kind": {"enum": ["webhook", "alertmanager", "slack", "pagerduty"]},
                       "project": {"type": "string"}, **_CHANNEL_FIELDS},
        "required": ["kind", "name"],
        "additionalProperties": False,
    },
    "ChannelUpdate": {
        "type": "object",
        "properties": {
            **_CHANNEL_FIELDS,
            "rotate_secret": {"type": "boolean", "description": "add a new generated secret (returned once); "
                                                                "old ones keep signing until retired"},
            "retire_secrets": {"type": "boolean", "description": "keep only the newest secret"},
        },
        "additionalProperties": False,
    },
    "DeliveryAttempt": {
        "type": "object",
        "properties": {
            "attempt": {"type": "integer"}, "started_at": {"type": "string", "format": "date-time"},
            "duration_ms": {"type": ["number", "null"]},
            "outcome": {"enum": ["succeeded", "transient", "permanent", "gone", "refused"]},
            "status_code": {"type": ["integer", "null"]}, "error": _STR_OR_NULL, "url": _STR_OR_NULL,
            "response_excerpt": _STR_OR_NULL,
        },
    },
    "Delivery": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"}, "channel": {"type": "integer"},
            "webhook_id": {"type": "string", "description": "the webhook-id header: the idempotency key"},
            "event_id": {"type": "string"}, "fingerprint": {"type": "string"},
            "event_status": {"enum": ["firing", "resolved"]}, "severity": {"type": "string"},
            "status": {"enum": ["pending", "sending", "succeeded", "failed", "dead"]},
            "attempts": {"type": "integer"}, "next_attempt_at": _STR_OR_NULL,
            "last_status_code": {"type": ["integer", "null"]}, "last_error": _STR_OR_NULL,
            "last_duration_ms": {"type": ["number", "null"]}, "is_test": {"type": "boolean"},
            "created_at": {"type": "string"}, "updated_at": {"type": "string"}, "delivered_at": _STR_OR_NULL,
            "log": {"type": "array", "items": _ref("DeliveryAttempt")},
        },
    },
}

PATHS: dict = {
    "/api/v1/channels": {
        "get": {
            "summary": "Notification channels of a project (viewer)",
            "parameters": [_PROJECT],
            "responses": {"200": _json({"type": "object", "properties": {
                "channels": {"type": "array", "items": _ref("Channel")}}}, "channels"), **_ERRORS},
        },
        "post": {
            "summary": "Create a channel (admin); a generated signing secret is returned once",
            "parameters": [_PROJECT],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ChannelCreate")}}},
            "responses": {
                "201": _json({"type": "object", "properties": {
                    "channel": _ref("Channel"), "secrets": {"type": "array", "items": {"type": "string"}}}},
                    "created"),
                "409": {**_ERR, "description": "a channel with that name exists in the project"},
                **_ERRORS,
            },
        },
    },
    "/api/v1/channels/{channel_id}": {
        "parameters": [_ID],
        "get": {"summary": "One channel (viewer)",
                "responses": {"200": _json({"type": "object", "properties": {"channel": _ref("Channel")}},
                                           "channel"), **_ERRORS}},
        "patch": {
            "summary": "Change a channel (admin): settings, enable/disable, rotate or retire secrets",
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ChannelUpdate")}}},
            "responses": {"200": _json({"type": "object", "properties": {
                "channel": _ref("Channel"), "new_secret": {"type": "string"}}}, "updated"), **_ERRORS},
        },
        "delete": {"summary": "Delete a channel and its delivery log (admin)",
                   "responses": {"204": {"description": "deleted"}, **_ERRORS}},
    },
    "/api/v1/channels/{channel_id}/test": {
        "parameters": [_ID],
        "post": {
            "summary": "Send a test notification now (admin); never retried",
            "responses": {"200": _json({"type": "object", "properties": {"delivery": _ref("Delivery")}},
                                       "the test delivery, succeeded or failed"), **_ERRORS},
        },
    },
    "/api/v1/channels/{channel_id}/deliveries": {
        "parameters": [_ID],
        "get": {
            "summary": "The channel's delivery log, newest first (viewer)",
            "parameters": [
                {"name": "status", "in": "query", "schema": {"enum": ["pending", "sending", "succeeded", "failed",
                                                                      "dead"]}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 200,
                                                            "default": 50}},
                {"name": "before", "in": "query", "schema": {"type": "integer"},
                 "description": "only deliveries with a smaller id (the next_before of the previous page)"},
            ],
            "responses": {"200": _json({"type": "object", "properties": {
                "channel": {"type": "integer"}, "deliveries": {"type": "array", "items": _ref("Delivery")},
                "next_before": {"type": ["integer", "null"]}}}, "deliveries"), **_ERRORS},
        },
    },
}
