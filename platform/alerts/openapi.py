"""OpenAPI paths and schemas of the alerts app, merged into /api/v1/openapi.json by observatory/openapi.py."""
PATHS: dict = {}
SCHEMAS: dict = {}
