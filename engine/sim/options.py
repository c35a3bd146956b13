"""Simulator-only parameters (not vLLM knobs): acceptance rates, the API server's costs, the KV pool override."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.sim.request import SimRequest


@dataclass(frozen=True)
class SimOptions:
    """Simulator-only parameters (not vLLM knobs)."""

    # Per-position acceptance rates for speculative decoding (position 1 first), replacing the method's default.
    acceptance_rates: tuple[float, ...] | None = None
    # API-server overhead, for the replica and virtual time: a fixed cost per request (HTTP parsing,
    # validation, response), tokenisation per prompt token before the engine sees the request, and
    # detokenisation per output token after the last one.
    api_overhead_seconds: float | None = None  # None: the hardware profile's api_overhead
    tokenize_seconds_per_token: float = 1.5e-6
    detokenize_seconds_per_token: float = 2.0e-6
    # vLLM's --num-gpu-blocks-override: fix the KV pool size instead of planning it from memory.
    num_gpu_blocks_override: int | None = None
    # Aggregate decoding requests and allow multi-step runs (see the module docstring).
    fast_path: bool = True
    # Keep (inter-token gap, number of requests) samples for ITL percentiles (virtual time turns this on).
    record_itl: bool = False
    # The API server admits requests one at a time: a request arriving while it works on others waits its turn
    # for its share of the fixed cost and tokenisation (vLLM's API server is one Python process, and on the CPU
    # build that cost is CPU time on the cores the engine uses). False: each request is delayed by its own API time
    # alone (a GPU host's API cost is mostly latency, not one core's work). None: the hardware profile's.
    api_server_serial: bool | None = None
    # The API server's work per streamed output token (HardwareProfile.api_token_overhead), queued in the order the
    # engine makes tokens; None: the hardware profile's.
    api_seconds_per_output_token: float | None = None
    # The API server's work per server-sent event (HardwareProfile.api_event_overhead): a stream whose previous
    # output the server has not sent yet gets this step's tokens merged into it; None: the hardware profile's.
    api_seconds_per_event: float | None = None

    def __post_init__(self) -> None:
        for name in ("api_overhead_seconds", "tokenize_seconds_per_token", "detokenize_seconds_per_token",
                     "api_seconds_per_output_token", "api_seconds_per_event"):
            value = getattr(self, name)
            if value is None and name in ("api_overhead_seconds", "api_seconds_per_output_token",
                                          "api_seconds_per_event"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"SimOptions.{name} must be a number >= 0, not {value!r}")
        override = self.num_gpu_blocks_override
        if override is not None and (isinstance(override, bool) or not isinstance(override, int) or override < 2):
            raise ValueError(f"SimOptions.num_gpu_blocks_override must be an integer >= 2, not {override!r}")

    def resolved_for(self, hardware) -> SimOptions:
        """These options with the API overhead and admission taken from the hardware profile where not set."""
        changes = {}
        if self.api_overhead_seconds is None:
            changes["api_overhead_seconds"] = hardware.api_overhead
        if self.api_server_serial is None:
            changes["api_server_serial"] = hardware.api_server_serial
        if self.api_seconds_per_output_token is None:
            changes["api_seconds_per_output_token"] = hardware.api_token_overhead
        if self.api_seconds_per_event is None:
            changes["api_seconds_per_event"] = hardware.api_event_overhead
        return dataclasses.replace(self, **changes) if changes else self

    def api_time_before(self, prompt_tokens: int) -> float:
        """Seconds between a request's arrival and the engine core queueing it (half the fixed cost + tokenising)."""
        return self.api_overhead_seconds / 2 + self.tokenize_seconds_per_token * prompt_tokens

    def api_time_after(self, output_tokens: int) -> float:
        """Seconds between the last token and the response completing (half the fixed cost + detokenising)."""
        return self.api_overhead_seconds / 2 + self.detokenize_seconds_per_token * output_tokens

    @staticmethod
    def client_first_token(request: SimRequest) -> float:
        """When the client receives the first token: the engine's time plus the API server's stream lag."""
        return request.first_token_time + request.stream_lag_first

    def client_end(self, request: SimRequest) -> float:
        """When the client has the whole response: the last token through the stream, then the API's time after."""
        return request.finished_time + request.stream_lag_last + self.api_time_after(request.num_generated)
