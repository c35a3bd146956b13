"""What one load run does: the validated ``LoadSpec`` (target, arrivals, request contents, SLOs, telemetry).

Every field is checked by ``LoadSpec.problems()``; the CLI turns each problem into an
argparse error and ``run_load`` refuses a spec that has any. Units are explicit in the
names: seconds for times, requests per second for rates, milliseconds for SLOs (as in
vLLM's ``--goodput ttft:MS``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

ENDPOINTS = ("completions", "chat")
ARRIVALS = ("poisson", "constant", "burst", "replay")
# The SLO keys vLLM's ``--goodput`` accepts, in its order.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
SHAREGPT = "sharegpt"
DEFAULT_BASE_URL = "http://127.0.0.1:8100/v1"
DEFAULT_PERCENTILES = (90.0, 99.0)
# Body keys the generator owns: changing them would make the measurement lie (e.g. "stream" flips the parser).
RESERVED_BODY_KEYS = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
                                "stream_options", "n", "best_of"})
# Any output the generator asks for stays below this; a larger value is a typo, not a workload.
MAX_TOKENS_LIMIT = 1_000_000


class SpecError(ValueError):
    """A spec that cannot run; ``problems`` lists every reason, each naming the option."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class LengthRange:
    """A token length: ``low == high`` is fixed, otherwise uniform over the integers in [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"N"`` (fixed) or ``"LO:HI"`` (uniform, inclusive); raises ValueError with the reason."""
        text = text.strip()
        parts = text.split(":")
        if len(parts) > 2 or not all(part.strip() for part in parts):
            raise ValueError(f"expected N or LO:HI, got {text!r}")
        try:
            values = [int(part) for part in parts]
        except ValueError:
            raise ValueError(f"expected whole numbers as N or LO:HI, got {text!r}") from None
        return cls(values[0], values[-1])

    def problems(self, name: str, minimum: int) -> list[str]:
        if self.low < minimum:
            return [f"{name} must be >= {minimum} (got {self.low})"]
        if self.high < self.low:
            return [f"{name}: the upper bound {self.high} is below the lower bound {self.low}"]
        if self.high > MAX_TOKENS_LIMIT:
            return [f"{name} must be <= {MAX_TOKENS_LIMIT} (got {self.high})"]
        return []

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def parse_goodput(items: list[str] | tuple[str, ...] | str) -> dict[str, float]:
    """vLLM's ``--goodput`` syntax: ``ttft:MS tpot:MS e2el:MS`` (any subset, each at most once) → {metric: ms}."""
    if isinstance(items, str):
        items = items.replace(",", " ").split()
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(
                f"invalid goodput SLO {item!r}: use KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_METRICS)}"
            )
        if key in slos:
            raise ValueError(f"goodput SLO {key!r} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"invalid goodput SLO {item!r}: milliseconds must be a finite number >= 0")
        slos[key] = ms
    return slos


def _positive(value: float | None) -> bool:
    return value is not None and not math.isnan(value) and value > 0


@dataclasses.dataclass
class LoadSpec:
    """One load run. Defaults give vLLM's ShareGPT-like workload as a Poisson stream at 1 request/s."""

    base_url: str = DEFAULT_BASE_URL
    model: str | None = None  # None: the first model the endpoint lists at GET {base_url}/models
    endpoint: str = "completions"  # "completions" → /completions, "chat" → /chat/completions
    stream: bool = True

    # Arrivals: how many (num_requests and/or duration, whichever ends first) and when.
    arrival: str = "poisson"
    rate: float = 1.0  # requests/s; math.inf sends everything at once (poisson/constant only)
    burstiness: float = 1.0  # gamma shape as in vLLM's --burstiness; 1.0 is a Poisson process
    burst_size: int | None = None  # burst: N requests every burst_interval seconds ...
    burst_interval: float | None = None
    burst_on: float | None = None  # ... or on/off: `rate` requests/s during burst_on s, then burst_off s silent
    burst_off: float | None = None
    trace: str | None = None  # replay: JSONL with a per-line offset/timestamp (see arrivals.load_trace)
    replay_speed: float = 1.0  # 2.0 replays the trace twice as fast
    num_requests: int | None = None
    duration: float | None = None  # seconds during which requests are sent (in flight ones then finish)
    max_concurrency: int | None = None

    # Request contents.
    dataset: str = SHAREGPT  # "sharegpt" (synthetic, lognormal lengths) or a JSONL file
    input_len: LengthRange | None = None
    output_len: LengthRange | None = None
    seed: int = 0
    # The first N tokens of every synthetic prompt are the same text (a system prompt the prefix cache can serve).
    shared_prefix_len: int = 0
    extra_body: Mapping[str, Any] | None = None  # merged into every request body (e.g. temperature)

    # Results.
    goodput: Mapping[str, float] | None = None  # {"ttft"|"tpot"|"e2el": ms}
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES

    # Transport and telemetry.
    api_key: str | None = None
    timeout: float = 600.0  # seconds, per request, whole response included
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    otlp_headers: Mapping[str, str] | None = None

    @property
    def api_url(self) -> str:
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        return self.base_url.rstrip("/") + path

    @property
    def models_url(self) -> str:
        return self.base_url.rstrip("/") + "/models"

    @property
    def operation(self) -> str:
        """The GenAI operation name of the requests this spec sends."""
        return "chat" if self.endpoint == "chat" else "text_completion"

    def problems(self) -> list[str]:
        """Every reason this spec cannot run (empty when it can)."""
        out: list[str] = []
        parsed = urlsplit(self.base_url or "")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            out.append(f"--base-url must be an http(s) URL such as {DEFAULT_BASE_URL} (got {self.base_url!r})")
        else:
            try:
                parsed.port  # noqa: B018 - raises ValueError on a bad port
            except ValueError:
                out.append(f"--base-url has an invalid port: {self.base_url!r}")
        if self.model is not None and not self.model.strip():
            out.append("--model must not be empty")
        if self.endpoint not in ENDPOINTS:
            out.append(f"--endpoint must be one of {', '.join(ENDPOINTS)} (got {self.endpoint!r})")
        out.extend(self._arrival_problems())
        if self.num_requests is not None and self.num_requests < 1:
            out.append(f"--num-requests must be >= 1 (got {self.num_requests})")
        if self.duration is not None and not (_positive(self.duration) and math.isfinite(self.duration)):
            out.append(f"--duration must be a finite number of seconds > 0 (got {self.duration})")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            out.append(f"--max-concurrency must be >= 1 (got {self.max_concurrency})")
        if self.dataset != SHAREGPT and not os.path.isfile(self.dataset):
            out.append(f"--dataset must be 'sharegpt' or an existing JSONL file (no file {self.dataset!r})")
        if self.input_len is not None:
            out.extend(self.input_len.problems("--input-len", 1))
        if self.output_len is not None:
            out.extend(self.output_len.problems("--output-len", 1))
        if not isinstance(self.shared_prefix_len, int) or not 0 <= self.shared_prefix_len <= MAX_SHARED_PREFIX:
            out.append(f"--shared-prefix-len must be a whole number of tokens in [0, {MAX_SHARED_PREFIX}] "
                       f"(got {self.shared_prefix_len!r})")
        elif self.shared_prefix_len and self.dataset != SHAREGPT:
            out.append("--shared-prefix-len applies to synthetic prompts only (not with a --dataset file)")
        for key, ms in (self.goodput or {}).items():
            if key not in GOODPUT_METRICS:
                out.append(f"--goodput: unknown metric {key!r}; use {', '.join(GOODPUT_METRICS)}")
            elif not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
                out.append(f"--goodput {key}: milliseconds must be a finite number >= 0 (got {ms!r})")
        if not self.stream and self.goodput and ({"ttft", "tpot"} & set(self.goodput)):
            out.append("--goodput ttft/tpot need streaming; without it only e2el can be measured")
        for p in self.percentiles:
            if not isinstance(p, (int, float)) or not 0 < p < 100:
                out.append(f"--percentiles must be numbers strictly between 0 and 100 (got {p!r})")
        if not (_positive(self.timeout) and math.isfinite(self.timeout)):
            out.append(f"--timeout must be a finite number of seconds > 0 (got {self.timeout})")
        if self.otlp_protocol is not None and self.otlp_protocol not in OTLP_PROTOCOLS:
            out.append(f"--otlp-protocol must be one of {', '.join(OTLP_PROTOCOLS)} (got {self.otlp_protocol!r})")
        if self.extra_body is not None:
            if not isinstance(self.extra_body, Mapping):
                out.append("--extra-body must be a JSON object")
            elif RESERVED_BODY_KEYS & set(self.extra_body):
                names = ", ".join(sorted(RESERVED_BODY_KEYS & set(self.extra_body)))
                out.append(f"--extra-body cannot set {names}: the load generator sets them (see --help)")
        return out

    def _arrival_problems(self) -> list[str]:
        out: list[str] = []
        if self.arrival not in ARRIVALS:
            return [f"--arrival must be one of {', '.join(ARRIVALS)} (got {self.arrival!r})"]
        rate_ok = _positive(self.rate)
        if self.arrival in ("poisson", "constant"):
            if not rate_ok:
                out.append(f"--rate must be > 0 requests/s, or inf (got {self.rate})")
            elif math.isinf(self.rate) and self.num_requests is None:
                out.append("--rate inf sends everything at once: give --num-requests")
            if self.arrival == "poisson" and not (_positive(self.burstiness) and math.isfinite(self.burstiness)):
                out.append(f"--burstiness must be a finite number > 0 (got {self.burstiness})")
        elif self.arrival == "burst":
            periodic = self.burst_size is not None or self.burst_interval is not None
            on_off = self.burst_on is not None or self.burst_off is not None
            if periodic == on_off:
                out.append(
                    "--arrival burst needs either --burst-size and --burst-interval, "
                    "or --burst-on and --burst-off (with --rate)"
                )
            elif periodic:
                if self.burst_size is None or self.burst_size < 1:
                    out.append(f"--burst-size must be >= 1 (got {self.burst_size})")
                if not (_positive(self.burst_interval) and math.isfinite(self.burst_interval)):
                    out.append(f"--burst-interval must be a finite number of seconds > 0 (got {self.burst_interval})")
            else:
                if not (_positive(self.burst_on) and math.isfinite(self.burst_on)):
                    out.append(f"--burst-on must be a finite number of seconds > 0 (got {self.burst_on})")
                if self.burst_off is None or math.isnan(self.burst_off) or self.burst_off < 0 or math.isinf(
                    self.burst_off
                ):
                    out.append(f"--burst-off must be a finite number of seconds >= 0 (got {self.burst_off})")
                if not (rate_ok and math.isfinite(self.rate)):
                    out.append(f"--rate (requests/s during --burst-on) must be finite and > 0 (got {self.rate})")
        else:  # replay
            if not self.trace:
                out.append("--arrival replay needs --trace FILE.jsonl")
            elif not os.path.isfile(self.trace):
                out.append(f"--trace: no file {self.trace!r}")
            if not (_positive(self.replay_speed) and math.isfinite(self.replay_speed)):
                out.append(f"--replay-speed must be a finite number > 0 (got {self.replay_speed})")
        if self.arrival != "replay" and self.num_requests is None and self.duration is None:
            out.append(f"--arrival {self.arrival} needs --num-requests and/or --duration")
        return out

    def validate(self) -> LoadSpec:
        problems = self.problems()
        if problems:
            raise SpecError(problems)
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the API key is never written out, only whether one was used."""
        data = dataclasses.asdict(self)
        data["input_len"] = str(self.input_len) if self.input_len else None
        data["output_len"] = str(self.output_len) if self.output_len else None
        data["rate"] = _json_float(self.rate)
        data["percentiles"] = list(self.percentiles)
        data["goodput"] = dict(self.goodput) if self.goodput else None
        data["extra_body"] = dict(self.extra_body) if self.extra_body else None
        data["api_key"] = None
        data["api_key_set"] = bool(self.api_key)
        # Header values are credentials: only their names are kept.
        data["otlp_headers"] = None
        data["otlp_header_names"] = sorted(self.otlp_headers) if self.otlp_headers else []
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadSpec:
        """Rebuild a spec written by ``to_dict`` (unknown keys ignored, secrets absent)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        for key in ("input_len", "output_len"):
            if values.get(key) is not None:
                values[key] = LengthRange.parse(str(values[key]))
        if "rate" in values:
            values["rate"] = float(values["rate"])
        if values.get("percentiles") is not None:
            values["percentiles"] = tuple(float(p) for p in values["percentiles"])
        values["api_key"] = None
        values["otlp_headers"] = None
        return cls(**values)


MAX_SHARED_PREFIX = 32_768


def _json_float(value: float) -> float | str:
    """JSON has no infinity: ``inf`` is written as the string "inf" (``float("inf")`` reads it back)."""
    return "inf" if math.isinf(value) else value
