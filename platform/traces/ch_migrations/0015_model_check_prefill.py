"""A live check of an engine model keeps its p50 prefill-time error, the figure it is now judged on with p50 TPOT.

Why: a check was judged on p50 TTFT and TPOT, while a study's bound on the latest traffic and the drift alert judged
p50 prefill time (the engine's TTFT less its queue) and TPOT (tuning/calibration.LIVE_GATED). Under a load the group
cannot keep up with, the queue grows by the minute and moves the median TTFT several-fold whatever the model's costs:
an SLO on `engine_model_error` then burned when the loop paged for the queue, with the model still fitting. A check's
`worst_error` is now the larger of |p50 prefill error| and |p50 TPOT error|; `ttft_p50_error` is still written, for
reading.

New column (no sorting-key change, so re-runnable): `prefill_p50_error` Nullable(Float64) after `ttft_p50_error`;
NULL in the rows written before (their `worst_error` is what they were judged on then). backwards drops it.
"""
from traces.ch_schema import RenderContext

blocking = False

TABLE = "engine_model_checks"


def _names(ctx: RenderContext) -> list[str]:
    return [TABLE + "_local", TABLE] if ctx.cluster else [TABLE]


def forwards(ctx: RenderContext) -> list[str]:
    return [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} ADD COLUMN IF NOT EXISTS `prefill_p50_error` "
            "Nullable(Float64) AFTER `ttft_p50_error`" for name in _names(ctx)]


def backwards(ctx: RenderContext) -> list[str]:
    return [f"ALTER TABLE {ctx.qualified(name)}{ctx.on_cluster} DROP COLUMN IF EXISTS `prefill_p50_error`"
            for name in _names(ctx)]
