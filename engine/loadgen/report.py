"""What a person sees: the summary table (vLLM's layout) and a one-line progress bar on stderr."""
from __future__ import annotations

import math
import sys
import time
from typing import Protocol, TextIO

from engine.loadgen.client import RequestRecord
from engine.loadgen.metrics import METRIC_TITLES, METRICS, Summary

_WIDTH = 50
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def _row(label: str, value: object) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40} {text:<10}"


def format_summary(summary: Summary, *, model: str | None = None, max_concurrency: int | None = None) -> str:
    """The summary as vLLM's ``Serving Benchmark Result`` block (plus failures, goodput SLOs and errors)."""
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]
    if model:
        lines.append(_row("Model:", model))
    lines.append(_row("Maximum request concurrency:", max_concurrency if max_concurrency else "not set"))
    lines += [
        _row("Successful requests:", summary.completed),
        _row("Failed requests:", summary.failed),
        _row("Benchmark duration (s):", summary.duration),
        _row("Total input tokens:", summary.total_input_tokens),
        _row("Total generated tokens:", summary.total_output_tokens),
        _row("Request throughput (req/s):", summary.request_throughput),
    ]
    if summary.request_goodput is not None:
        lines.append(_row("Goodput SLOs (ms):", " ".join(f"{k}:{v:g}" for k, v in summary.goodput_slos.items())))
        lines.append(_row("Request goodput (req/s):", summary.request_goodput))
    lines += [
        _row("Output token throughput (tok/s):", summary.output_throughput),
        _row("Total Token throughput (tok/s):", summary.total_token_throughput),
        _row("Peak concurrent requests:", summary.max_concurrent_requests),
    ]
    for metric in METRICS:
        stats = summary.stats[metric]
        label = _LABELS[metric]
        lines.append(METRIC_TITLES[metric].center(_WIDTH, "-"))
        lines.append(_row(f"Mean {label} (ms):", stats.mean))
        lines.append(_row(f"Median {label} (ms):", stats.median))
        lines.append(_row(f"Std {label} (ms):", stats.std))
        for key, value in stats.percentiles.items():
            lines.append(_row(f"P{key[1:]} {label} (ms):", value))
    if summary.errors:
        lines.append(" Errors ".center(_WIDTH, "-"))
        for error_type, count in sorted(summary.errors.items(), key=lambda item: -item[1]):
            lines.append(_row(f"{error_type}:", count))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


class Progress(Protocol):
    """What ``run_load`` reports progress to."""

    def start(self, total: int) -> None: ...

    def advance(self, record: RequestRecord) -> None: ...

    def close(self) -> None: ...


class ProgressBar:
    """A single self-rewriting line on a terminal: done/total, successes, failures and elapsed time.

    It draws nothing when the stream is not a TTY (logs, pipes, CI) or ``enabled`` is False,
    and redraws at most ten times a second so it costs nothing at high request rates.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None, min_interval: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.min_interval = min_interval
        self.total = 0
        self.done = self.ok = self.failed = 0
        self.started = time.monotonic()
        self._last_draw = -math.inf
        self._running = False

    def start(self, total: int) -> None:
        self.total = total
        self._running = True
        self.started = time.monotonic()
        self._draw(force=True)

    def advance(self, record: RequestRecord) -> None:
        self.done += 1
        if record.success:
            self.ok += 1
        else:
            self.failed += 1
        self._draw(force=self.done >= self.total)

    def close(self) -> None:
        if self.enabled and self._running:
            self._running = False
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        elapsed = now - self.started
        fraction = self.done / self.total if self.total else 1.0
        filled = round(fraction * 30)
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:5.1f}% {self.done}/{self.total} requests, "
            f"{self.ok} ok, {self.failed} failed, {elapsed:6.1f} s "
        )
        self.stream.flush()
