"""A simulated vLLM replica: vLLM's OpenAI-compatible API, ``llm_request`` spans and metrics, in real time.

``build_replica_app`` gives the aiohttp app, ``ReplicaServer`` runs one inside another
asyncio program, and ``python -m engine.replica`` (``engine.replica.cli.main``) runs one
as a process. The only visible difference from vLLM is the span resource attribute
``llm_observatory.simulated=true``.
"""
from engine.replica.app import build_replica_app, replica_state
from engine.replica.server import ReplicaServer, run_replica
from engine.replica.spans import build_replica_tracer_provider, replica_resource_attributes

__all__ = [
    "ReplicaServer",
    "build_replica_app",
    "build_replica_tracer_provider",
    "replica_resource_attributes",
    "replica_state",
    "run_replica",
]
