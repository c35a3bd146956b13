"""How a supervised process is watched and restarted: the timings of health checks, restarts and draining."""
from __future__ import annotations

import dataclasses
import math
import random


@dataclasses.dataclass(frozen=True)
class SupervisorPolicy:
    """Timings of health checks, restarts and draining (seconds)."""

    health_path: str = "/health"
    metrics_path: str = "/metrics"
    health_interval: float = 2.0
    health_timeout: float = 2.0
    unhealthy_threshold: int = 3
    # The simulator is up in about a second; vLLM loads weights and captures CUDA graphs for minutes.
    startup_timeout: float = 120.0
    startup_poll_interval: float = 0.25
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    backoff_multiplier: float = 2.0
    # Fraction of the delay drawn at random, so replicas that crash together do not restart in lockstep.
    backoff_jitter: float = 0.2
    stable_after: float = 60.0
    drain_timeout: float = 60.0
    drain_poll_interval: float = 0.5
    terminate_grace: float = 10.0

    def __post_init__(self) -> None:
        problems = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_path"):
                if not isinstance(value, str) or not value.startswith("/"):
                    problems.append(f"{field.name} must be a URL path starting with '/', not {value!r}")
            elif field.name == "unhealthy_threshold":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    problems.append(f"unhealthy_threshold must be an integer >= 1, not {value!r}")
            elif field.name == "backoff_jitter":
                if not _is_number(value) or not 0 <= value < 1:
                    problems.append(f"backoff_jitter must be a number in [0, 1), not {value!r}")
            elif field.name == "backoff_multiplier":
                if not _is_number(value) or value < 1:
                    problems.append(f"backoff_multiplier must be a number >= 1, not {value!r}")
            elif not _is_number(value) or value <= 0:
                problems.append(f"{field.name} must be a positive number of seconds, not {value!r}")
        if not problems and self.backoff_initial > self.backoff_max:
            problems.append(f"backoff_initial ({self.backoff_initial}) must be <= backoff_max ({self.backoff_max})")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_dict(cls, data: object) -> SupervisorPolicy:
        """From YAML/JSON data; unknown keys are errors."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"supervision settings must be a mapping, not {type(data).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise ValueError(
                f"unknown supervision setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        return cls(**data)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def backoff_delay(attempt: int, policy: SupervisorPolicy, rng: random.Random | None = None) -> float:
    """Seconds to wait before restart number ``attempt + 1``: exponential, capped, minus a random jitter share."""
    base = policy.backoff_initial * policy.backoff_multiplier ** min(max(attempt, 0), 64)
    base = min(base, policy.backoff_max)
    draw = (rng or random).random()
    return base * (1.0 - policy.backoff_jitter * draw)
