"""Wires the managed engine (gateway, replicas, load generator) to this platform's OTLP endpoint.

The engine imports nothing from Django; the platform hands it the standard OTel environment instead: where to send
spans (this platform's OTLP/HTTP endpoint) and an ingest key of the project its traffic belongs to. That key is
created once and kept in the data directory (mode 0600), so restarts do not pile up keys; a revoked or lost key is
replaced.
"""
from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.db import transaction
from tenancy.models import IngestKey, Project, hash_secret

ENGINE_KEY_NAME = "managed engine"


def _key_file(project: str) -> Path:
    return Path(settings.DATA_DIR) / "engine" / f"ingest-key-{project}"


def engine_ingest_key(project: str = "default") -> str:
    """The ingest key the managed engine uses for ``project`` (created, with the project, when missing or revoked)."""
    path = _key_file(project)
    if path.exists():
        raw = path.read_text(encoding="utf-8").strip()
        if raw and IngestKey.objects.filter(
            key_hash=hash_secret(raw), revoked_at__isnull=True, project__name=project
        ).exists():
            return raw
    with transaction.atomic():
        proj, _ = Project.objects.get_or_create(name=project)
        _, raw = IngestKey.issue(proj, name=ENGINE_KEY_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(raw + "\n")
    return raw


def _reachable(bind: str) -> str:
    """host:port to reach a server bound to ``bind`` from this host (a wildcard address becomes 127.0.0.1)."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def platform_grpc_endpoint(grpc_bind: str | None = None) -> str:
    """host:port of this platform's OTLP/gRPC receiver, as vLLM's --otlp-traces-endpoint takes it."""
    return _reachable(grpc_bind or settings.OTLP_GRPC_BIND)


def platform_traces_url(http_bind: str | None = None) -> str:
    return f"http://{_reachable(http_bind or settings.HTTP_BIND)}/v1/traces"


def engine_environment(project: str = "default", http_bind: str | None = None) -> dict[str, str]:
    """Environment pointing the fleet (``ENGINE_OTLP_*``) and the load generator (``OTEL_*``) at this platform.

    Both export OTLP/HTTP protobuf to the web port with the engine's ingest key; the
    run directory sits in the platform's data directory.
    """
    url = platform_traces_url(http_bind)
    key = engine_ingest_key(project)
    return {
        "ENGINE_RUN_DIR": str(Path(settings.DATA_DIR) / "engine"),
        "ENGINE_OTLP_ENDPOINT": url,
        "ENGINE_OTLP_PROTOCOL": "http/protobuf",
        "ENGINE_OTLP_HEADERS": f"authorization=Bearer {key}",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"authorization=Bearer%20{key}",
    }
