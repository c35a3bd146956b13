"""Projects (the tenants), their ingest keys, users' roles in them and API tokens."""
