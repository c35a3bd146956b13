"""The benchmarks' timings: calls timed after an untimed warm-up, and the 90th percentile they report."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def timed(call: Callable[[], T], runs: int) -> tuple[list[float], T]:
    """The seconds each of ``runs`` calls of ``call`` took, after one untimed call that warms the caches, and what
    the last call returned."""
    result = call()
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        result = call()
        timings.append(time.perf_counter() - started)
    return timings, result


def p90(values: Sequence[float]) -> float:
    """The 90th percentile as the benchmarks report it: the value of rank ⌊0.9·n⌋ (the first, for fewer than
    two values) of the sorted values."""
    return sorted(values)[max(0, int(len(values) * 0.9) - 1)]
