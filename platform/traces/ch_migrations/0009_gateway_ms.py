"""Request rows of a chain of gateways carry the gateways' own processing time: `gateway_ms`.

Why: real topologies put two or three gateways in front of the engine (LiteLLM → a router → the
platform's gateway). Where a gateway shows its call to the next hop as a child span (LiteLLM's
`litellm_request`, an OpenTelemetry HTTP client span), the decomposition splits the gateway's own
processing from the network (traces/decomposition.py) and `gateway_ms` is their sum, so that
e2e = network + gateway + overhead + queue + prefill + decode exactly; NULL when no gateway's
processing could be told from the network (then `network_ms` holds both, as before). Per-hop
figures (network into each hop, a gateway's processing, or the two as one unattributed figure) live
in the `hops` JSON, which needs no migration.

Rows written before this migration have NULL, which is what a three-hop chain through the
platform's own gateway gives (it injects its own span as the parent of the engine's).

backwards drops the column.
"""
from traces.ch_schema import RenderContext

blocking = False


def forwards(ctx: RenderContext) -> list[str]:
    add = "ADD COLUMN IF NOT EXISTS `gateway_ms` Nullable(Float64) AFTER `network_gateway_engine_ms`"
    if ctx.cluster:
        return [f"ALTER TABLE {ctx.qualified('llm_requests_local')}{ctx.on_cluster} {add}",
                f"ALTER TABLE {ctx.qualified('llm_requests')}{ctx.on_cluster} {add}"]
    return [f"ALTER TABLE {ctx.qualified('llm_requests')} {add}"]


def backwards(ctx: RenderContext) -> list[str]:
    names = ["llm_requests", "llm_requests_local"] if ctx.cluster else ["llm_requests"]
    return [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} DROP COLUMN IF EXISTS `gateway_ms`" for name in names]
