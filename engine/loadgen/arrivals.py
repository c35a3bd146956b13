"""When requests are sent: arrival offsets (seconds from the start of a run) for each arrival process.

* Poisson (default, as vLLM's ``--request-rate``): gaps drawn from a gamma distribution
  with shape ``burstiness`` and mean ``1/rate``, exactly vLLM's ``--burstiness`` rule;
  shape 1 is the exponential, i.e. a Poisson process. The first request goes at 0.
  ``rate=inf`` sends everything at 0.
* Constant: request ``i`` at ``i / rate``, computed from ``i`` (not by summing gaps) so
  long runs do not drift.
* Burst, periodic: ``size`` requests at 0, ``interval``, ``2*interval`` …
* Burst, on/off: during each ``on``-second window, evenly spaced at ``rate``; then
  ``off`` seconds of silence.
* Replay: the offsets of a JSONL trace (``load_trace``), divided by a speed factor.

Every generator is infinite (except replay); ``bounded`` cuts one to a request count
and/or a duration.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

from engine.loadgen.workload import OUTPUT_FIELDS, WorkloadFileError, count_field, read_jsonl, text_fields


def poisson_offsets(rate: float, *, seed: int = 0, burstiness: float = 1.0) -> Iterator[float]:
    """Gamma(shape=burstiness, mean=1/rate) gaps from a seeded generator of its own."""
    if not rate > 0:
        raise ValueError("rate must be > 0")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError("burstiness must be a finite number > 0")
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    # A string seed gives a stream independent of the one drawing request lengths from the same --seed.
    rng = random.Random(f"loadgen-arrivals:{seed}")
    scale = 1.0 / (rate * burstiness)
    offset = 0.0
    while True:
        yield offset
        offset += rng.gammavariate(burstiness, scale)


def constant_offsets(rate: float) -> Iterator[float]:
    if not rate > 0:
        raise ValueError("rate must be > 0")
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    for i in itertools.count():
        yield i / rate


def burst_offsets(size: int, interval: float) -> Iterator[float]:
    """``size`` requests at once, every ``interval`` seconds."""
    if size < 1 or not interval > 0:
        raise ValueError("burst size must be >= 1 and interval > 0")
    for i in itertools.count():
        yield (i // size) * interval


def on_off_offsets(rate: float, on: float, off: float) -> Iterator[float]:
    """Evenly spaced at ``rate`` while on, silent while off; each on-window starts with a request."""
    if not (rate > 0 and math.isfinite(rate)) or not on > 0 or off < 0:
        raise ValueError("on/off bursts need a finite rate > 0, on > 0 and off >= 0")
    # Requests j with j / rate < on fit in a window; the tolerance keeps on*rate = 5.0 from becoming 6.
    per_window = max(1, math.ceil(on * rate - 1e-9))
    period = on + off
    for window in itertools.count():
        start = window * period
        for j in range(per_window):
            yield start + j / rate


def bounded(offsets: Iterable[float], *, count: int | None = None, duration: float | None = None) -> Iterator[float]:
    """The offsets before ``duration`` seconds, at most ``count`` of them."""
    if count is None and duration is None and not isinstance(offsets, (list, tuple)):
        raise ValueError("an unbounded arrival process needs a count or a duration")
    stream = iter(offsets)
    if count is not None:
        stream = itertools.islice(stream, count)
    for offset in stream:
        if duration is not None and offset >= duration:
            return
        yield offset


@dataclasses.dataclass(frozen=True)
class TraceEntry:
    """One request of a replayed trace: when (offset, seconds) and, optionally, what to send."""

    offset: float
    line: int
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None


class TraceError(WorkloadFileError):
    """A trace file that cannot be replayed; the message names the file and line."""


# Accepted time fields, in order of preference, with their factor to seconds. "timestamp" may also
# be an ISO 8601 string. Mooncake-style traces carry "timestamp" in milliseconds: use "timestamp_ms".
_TIME_FIELDS = (("offset", 1.0), ("offset_ms", 1e-3), ("timestamp", 1.0), ("timestamp_ms", 1e-3))
_INPUT_FIELDS = ("input_tokens", "input_length", "prompt_tokens")


def _time_of(obj: dict, where: str) -> tuple[str, float]:
    """("offset" | "timestamp", seconds) of a trace line."""
    for key, factor in _TIME_FIELDS:
        if key not in obj:
            continue
        value = obj[key]
        if key == "timestamp" and isinstance(value, str):
            try:
                moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise TraceError(f"{where}: 'timestamp' {value!r} is neither seconds nor ISO 8601") from None
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=datetime.timezone.utc)
            return "timestamp", moment.timestamp()
        if value.__class__ is bool or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TraceError(f"{where}: {key!r} must be a finite number (got {value!r})")
        if key.startswith("offset") and value < 0:
            raise TraceError(f"{where}: {key!r} must be >= 0 (got {value!r})")
        return key.split("_")[0], float(value) * factor
    raise TraceError(f"{where}: no time field; give one of {', '.join(k for k, _ in _TIME_FIELDS)}")


def load_trace(path: str) -> list[TraceEntry]:
    """Entries of a JSONL trace sorted by time (ties keep file order), the earliest at offset 0.

    Each line: a time — ``offset`` (seconds from the start), ``offset_ms``, ``timestamp``
    (seconds, e.g. Unix time, or an ISO 8601 string) or ``timestamp_ms`` — and optionally
    ``prompt`` or ``messages``, ``input_tokens`` (aliases ``input_length``, ``prompt_tokens``)
    and ``output_tokens`` (aliases ``max_tokens``, ``output_length``). Timestamps are made
    relative to the earliest one; all lines must use the same kind (offsets or timestamps).
    Blank lines and lines starting with ``#`` are skipped. What a line leaves out comes
    from the workload (``--dataset``, ``--input-len``, ``--output-len``).
    """
    raw: list[tuple[float, int, dict[str, Any]]] = []
    kinds: set[str] = set()
    try:
        for number, obj in read_jsonl(path):
            where = f"{path}:{number}"
            kind, seconds = _time_of(obj, where)
            content = text_fields(obj, where)
            content["input_tokens"] = count_field(obj, _INPUT_FIELDS, where)
            content["output_tokens"] = count_field(obj, OUTPUT_FIELDS, where)
            kinds.add(kind)
            raw.append((seconds, number, content))
    except TraceError:
        raise
    except WorkloadFileError as exc:
        raise TraceError(str(exc)) from None
    if not raw:
        raise TraceError(f"{path}: the trace has no entries")
    if len(kinds) > 1:
        raise TraceError(f"{path}: mixes offsets and timestamps; use one kind of time field throughout")
    origin = min(seconds for seconds, _, _ in raw)
    raw.sort(key=lambda item: item[0])  # stable: equal times keep file order
    return [TraceEntry(offset=seconds - origin, line=number, **content) for seconds, number, content in raw]


def replay_offsets(entries: Iterable[TraceEntry], speed: float = 1.0) -> Iterator[float]:
    if not (speed > 0 and math.isfinite(speed)):
        raise ValueError("replay speed must be a finite number > 0")
    for entry in entries:
        yield entry.offset / speed
