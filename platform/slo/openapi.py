"""OpenAPI paths and schemas of the slo app, merged into /api/v1/openapi.json by observatory/openapi.py."""
PATHS: dict = {}
SCHEMAS: dict = {}
