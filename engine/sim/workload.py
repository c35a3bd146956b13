"""Workloads for virtual-time runs: Poisson arrivals with ShareGPT-like lengths, or fixed shapes.

The length distributions and the arrival process are the load generator's
(``engine.loadgen.workload.Workload.lengths`` and ``engine.loadgen.arrivals.poisson_offsets``),
so a simulated run and a real load test against a replica draw the same requests
for the same seed.
"""
from __future__ import annotations

from collections.abc import Iterator

from engine.loadgen.arrivals import poisson_offsets
from engine.loadgen.workload import Workload
from engine.sim.request import SimRequest


def poisson_sharegpt(rate: float, *, duration: float | None = None, count: int | None = None,
                     seed: int = 0) -> list[SimRequest]:
    """Requests arriving as a Poisson process at ``rate``/s with ShareGPT-like prompt and output lengths.

    Stops after ``duration`` seconds of arrivals or ``count`` requests (whichever comes first;
    at least one must be given).
    """
    if duration is None and count is None:
        raise ValueError("give a duration or a count")
    workload = Workload(seed=seed)
    requests: list[SimRequest] = []
    for index, offset in enumerate(poisson_offsets(rate, seed=seed)):
        if (count is not None and index >= count) or (duration is not None and offset >= duration):
            break
        prompt, output = workload.lengths(index)
        requests.append(SimRequest(f"req-{index}", prompt, output, offset))
    return requests


def fixed_requests(count: int, prompt_tokens: int, output_tokens: int, *, rate: float | None = None,
                   seed: int = 0) -> list[SimRequest]:
    """``count`` identical-shape requests, all at time 0 (``rate=None``) or as a Poisson process at ``rate``/s."""
    offsets: Iterator[float] = poisson_offsets(rate, seed=seed) if rate else iter(lambda: 0.0, None)
    return [SimRequest(f"req-{index}", prompt_tokens, output_tokens, next(offsets)) for index in range(count)]
