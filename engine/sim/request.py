"""A request as the caller hands it to the simulated engine and as the engine keeps it, and what a step returns."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.sim.kv_cache import RequestBlocks


class RequestRejected(ValueError):
    """A request vLLM would refuse (its prompt plus output exceeds max_model_len, bad lengths, duplicate id)."""


@dataclass
class SimRequest:
    """One request as the simulated engine sees it; the engine fills the timestamps (caller's clock, seconds)."""

    request_id: str
    prompt_tokens: int  # prompt length
    output_tokens: int  # tokens to generate (the caller decides; >= 1)
    arrival_time: float
    prompt_token_ids: Sequence[int] | None = None  # for prefix-cache hashing; None = a unique prompt
    priority: int = 0  # lower value = served first under scheduling_policy=priority
    # Filled by the engine (None until it happens), as vLLM's request events:
    queued_time: float | None = None  # entered the engine core's waiting queue
    scheduled_time: float | None = None  # first scheduled (start of that step)
    first_token_time: float | None = None  # end of the step that sampled the first token
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first scheduling, in tokens
    num_preemptions: int = 0
    finish_reason: str | None = None  # "length" | "abort"
    # How long the API server's token stream lagged behind the engine when the first and the last token were made
    # (SimOptions.api_seconds_per_output_token; 0 when it keeps up): the client sees them that much later.
    stream_lag_first: float = 0.0
    stream_lag_last: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """What one engine step (or, from ``advance``, a run of identical decode steps) did."""

    start_time: float
    duration: float
    end_time: float
    new_tokens: dict[str, int] = field(default_factory=dict)  # request_id -> tokens emitted (0 omitted)
    finished: list[SimRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_preempted: int = 0
    num_steps: int = 1


# EngineRequest.state
WAITING, RUNNING, FINISHED = 0, 1, 2


class EngineRequest:
    """The engine's state of one request (vLLM's ``Request``), kept apart from the caller's SimRequest."""

    __slots__ = (
        "req", "order", "prompt", "output", "computed", "generated", "blocks", "state", "preempted",
        "agg", "t0", "c0", "g0", "key", "finish_tick", "last_emit", "scheduled", "long",
    )

    def __init__(self, req: SimRequest, order: int, prompt_hashes: Sequence[int] | None):
        self.req = req
        self.order = order
        self.prompt = req.prompt_tokens
        self.output = req.output_tokens
        self.computed = 0
        self.generated = 0
        self.blocks = RequestBlocks(order, prompt_hashes)
        self.state = WAITING
        self.preempted = False
        self.agg = False  # decoding inside the aggregate (computed/generated derived from the tick)
        self.t0 = self.c0 = self.g0 = self.key = self.finish_tick = 0
        self.last_emit = 0.0
        self.scheduled = False
        self.long = False

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.generated
