"""The engine's OpenAI-compatible gateway: weighted canary routing over replica groups, admission, tracing.

Clients (the load generator, users) talk to it as to vLLM; it forwards each request to a
replica (vLLM or the simulator), streaming answers through chunk by chunk, and emits
one OTel GenAI SERVER span per request that the platform reads as the GATEWAY hop.
"""
import importlib

# The names below load on first use (PEP 562): a module that needs only the cache's settings (engine.launcher.
# fleet_spec, and through it every Django process) does not pay for aiohttp and redis.
_HOMES = {"GATEWAY_KEY": "app", "Gateway": "app", "build_gateway_app": "app", "RunningGateway": "server",
          "main": "server", "serve_gateway": "server", "start_gateway": "server", "GatewaySettings": "settings",
          "GroupSpec": "settings", "RoutesError": "settings", "load_routes": "settings", "parse_routes": "settings"}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine.gateway' has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.gateway.{home}"), name)


__all__ = [
    "GATEWAY_KEY",
    "Gateway",
    "GatewaySettings",
    "GroupSpec",
    "RoutesError",
    "RunningGateway",
    "build_gateway_app",
    "load_routes",
    "main",
    "parse_routes",
    "serve_gateway",
    "start_gateway",
]
