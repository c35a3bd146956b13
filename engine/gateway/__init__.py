"""The engine's OpenAI-compatible gateway: weighted canary routing over replica groups, admission, tracing.

Clients (the load generator, users) talk to it as to vLLM; it forwards each request to a
replica (vLLM or the simulator), streaming answers through chunk by chunk, and emits
one OTel GenAI SERVER span per request that the platform reads as the GATEWAY hop.
"""
from engine.gateway.app import GATEWAY_KEY, Gateway, build_gateway_app
from engine.gateway.server import RunningGateway, main, serve_gateway, start_gateway
from engine.gateway.settings import GatewaySettings, GroupSpec, RoutesError, load_routes, parse_routes

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
