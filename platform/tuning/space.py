"""A study's search space over vLLM's knobs, its constraints, and the distance between configs.

A space is a mapping knob → choices (a list) or range (``{"low", "high"}``, integers
optionally ``"log": true``; floats for ``gpu_memory_utilization``):

    {"max_num_seqs": [64, 128, 256, 512, 1024],
     "max_num_batched_tokens": {"low": 1024, "high": 16384, "log": true},
     "speculative_method": ["none", "ngram"], "num_speculative_tokens": {"low": 1, "high": 5}}

Knob names are vLLM's (engine config keys); ``speculative_method`` (``none`` or one of
vLLM's methods; those drafting with a model need ``speculative_model``) and
``num_speculative_tokens`` build ``speculative_config``. The replica count is not a knob: goodput
per GPU does not depend on it (the study reports the replicas the peak rate needs). Every value
is checked alone on the current config: a value vLLM refuses (``max_num_seqs: 0``, ``gpu_memory_utilization: 1.2``, ``block_size: 24``) refuses
the space, naming the knob. Combinations vLLM refuses (``max_num_batched_tokens`` below
``max_num_seqs``, chunked prefill off with a budget under ``max_model_len``, a KV cache that
cannot hold one request) are constraints: ``check`` names them before any simulation runs.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from engine.config import DRAFT_MODEL_METHODS, SPECULATIVE_METHODS, ConfigError, EngineConfig
from engine.sim.core import EngineCore
from engine.sim.memory import SimulationConfigError

CONFIG_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
                "max_num_partial_prefills", "enable_prefix_caching", "block_size", "kv_cache_dtype",
                "gpu_memory_utilization", "tensor_parallel_size", "scheduling_policy")
SPEC_KNOBS = ("speculative_method", "num_speculative_tokens")
KNOBS = CONFIG_KNOBS + SPEC_KNOBS
FLOAT_KNOBS = frozenset({"gpu_memory_utilization"})
BOOL_KNOBS = frozenset({"enable_chunked_prefill", "enable_prefix_caching"})

# What a study searches when none is given: vLLM's batching, chunked-prefill and speculative-decoding knobs.
DEFAULT_SPACE: dict[str, Any] = {
    "max_num_seqs": [16, 32, 64, 128, 256, 512, 1024],
    "max_num_batched_tokens": [512, 1024, 2048, 4096, 8192, 16384],
    "enable_chunked_prefill": [True, False],
    "long_prefill_token_threshold": [0, 256, 1024, 4096],
    "enable_prefix_caching": [True, False],
    "kv_cache_dtype": ["auto", "fp8"],
    "gpu_memory_utilization": {"low": 0.8, "high": 0.95},
    "speculative_method": ["none", "ngram"],
    "num_speculative_tokens": {"low": 1, "high": 5},
}
PER_GPU_EXTRA: dict[str, Any] = {"tensor_parallel_size": [1, 2, 4]}


class SpaceError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class Space:
    def __init__(self, knobs: dict[str, Any], speculative_model: str | None = None):
        self.knobs = knobs
        self.speculative_model = speculative_model

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.knobs)
        if self.speculative_model:
            data["speculative_model"] = self.speculative_model
        return data

    # ------------------------------------------------------------------ sampling
    def suggest(self, trial) -> dict[str, Any]:
        """Draw one point with an Optuna trial (``num_speculative_tokens`` only when a method is drawn)."""
        point: dict[str, Any] = {}
        for knob, spec in self.knobs.items():
            if knob == "num_speculative_tokens" and point.get("speculative_method", "none") == "none" \
                    and "speculative_method" in self.knobs:
                continue
            if isinstance(spec, list):
                point[knob] = spec[0] if len(spec) == 1 else trial.suggest_categorical(knob, spec)
            elif knob in FLOAT_KNOBS:
                point[knob] = trial.suggest_float(knob, spec["low"], spec["high"], step=spec.get("step"))
            else:
                point[knob] = trial.suggest_int(knob, spec["low"], spec["high"], log=bool(spec.get("log")))
        return point

    def grid(self, knobs: tuple[str, ...] | None = None, float_steps: int = 3) -> list[dict[str, Any]]:
        """Every combination of the (given) knobs' values; ranges enumerated (log ranges in powers of two)."""
        names = [k for k in self.knobs if knobs is None or k in knobs]
        values = [self._values(k, float_steps) for k in names]
        points = []
        for combo in itertools.product(*values):
            point = dict(zip(names, combo))
            if point.get("speculative_method", "none") == "none" and "num_speculative_tokens" in point \
                    and "speculative_method" in point:
                if point["num_speculative_tokens"] != values[names.index("num_speculative_tokens")][0]:
                    continue
                point.pop("num_speculative_tokens")
            points.append(point)
        return points

    def _values(self, knob: str, float_steps: int) -> list[Any]:
        spec = self.knobs[knob]
        if isinstance(spec, list):
            return list(spec)
        low, high = spec["low"], spec["high"]
        if knob in FLOAT_KNOBS:
            return [round(low + (high - low) * i / max(1, float_steps - 1), 4) for i in range(float_steps)]
        if spec.get("log"):
            out, v = [], low
            while v < high:
                out.append(v)
                v *= 2
            return out + [high]
        return list(range(low, high + 1))

    def nearest(self, config: EngineConfig) -> dict[str, Any]:
        """The point of the space closest to ``config``'s resolved values (each knob on its own)."""
        resolved = config.resolved()
        spec = resolved.speculative_config
        values = {knob: getattr(resolved, knob) for knob in CONFIG_KNOBS}
        values["speculative_method"] = spec.method if spec else "none"
        values["num_speculative_tokens"] = spec.num_speculative_tokens if spec else None
        point: dict[str, Any] = {}
        for knob, choices in self.knobs.items():
            value = values.get(knob)
            if knob == "num_speculative_tokens" and point.get("speculative_method", "none") == "none" \
                    and "speculative_method" in self.knobs:
                continue
            if value is None:
                value = choices[0] if isinstance(choices, list) else choices["low"]
            if isinstance(choices, list):
                if value in choices:
                    point[knob] = value
                elif all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in choices) \
                        and isinstance(value, (int, float)):
                    point[knob] = min(choices, key=lambda c: abs(math.log(max(c, 1e-9)) - math.log(max(value, 1e-9))))
                else:
                    point[knob] = choices[0]
            else:
                low, high = choices["low"], choices["high"]
                point[knob] = min(max(value, low), high) if isinstance(value, (int, float)) else low
        return point

    def outside(self, current: EngineConfig, point: Mapping[str, Any]) -> list[str]:
        """The knobs of ``point`` whose value this space cannot reach, each said with what the space holds (a knob
        the space leaves out keeps the current config's resolved value)."""
        resolved = current.resolved()
        out = []
        for knob, value in point.items():
            spec = self.knobs.get(knob)
            if spec is None:
                held = getattr(resolved, knob, None)
                if value != held:
                    out.append(f"{knob} {value} (not searched: the study keeps {held})")
            elif isinstance(spec, list):
                if value not in spec:
                    out.append(f"{knob} {value} (the study searched {', '.join(str(v) for v in spec)})")
            elif not spec["low"] <= value <= spec["high"]:
                out.append(f"{knob} {value} (the study searched {spec['low']}–{spec['high']})")
        return out

    # ------------------------------------------------------------------ configs
    def config(self, current: EngineConfig, point: Mapping[str, Any]) -> EngineConfig:
        """The current config with ``point`` applied (validated: raises ConfigError naming every problem)."""
        changes = {k: v for k, v in point.items() if k in CONFIG_KNOBS}
        method = point.get("speculative_method")
        if method is not None or "num_speculative_tokens" in point:
            method = method if method is not None else (
                current.speculative_config.method if current.speculative_config else "none")
            if method == "none":
                changes["speculative_config"] = None
            else:
                k = point.get("num_speculative_tokens") or (
                    current.speculative_config.num_speculative_tokens if current.speculative_config else 3)
                spec: dict[str, Any] = {"method": method, "num_speculative_tokens": int(k)}
                if method in DRAFT_MODEL_METHODS:
                    spec["model"] = self.speculative_model
                changes["speculative_config"] = spec
        return current.replace(**changes)


def parse_space(data: Any, current: EngineConfig, *, per_gpu: bool = False) -> Space:
    """Validate a search space (None: the default one); raises SpaceError listing every problem."""
    if data is None:
        data = dict(DEFAULT_SPACE, **(PER_GPU_EXTRA if per_gpu else {}))
        if current.gpu_type == "CPU":
            data.pop("tensor_parallel_size", None)
            data.pop("kv_cache_dtype", None)
    if not isinstance(data, Mapping):
        raise SpaceError([f"the search space must be a mapping of knob to values, not {type(data).__name__}"])
    data = dict(data)
    speculative_model = data.pop("speculative_model", None)
    if speculative_model is not None and (not isinstance(speculative_model, str) or not speculative_model.strip()):
        raise SpaceError(["speculative_model must be a model name"])
    problems: list[str] = []
    knobs: dict[str, Any] = {}
    for knob, spec in data.items():
        if knob == "replicas":
            problems.append("replicas: not a search knob: with the load split evenly, goodput per GPU does not depend "
                            "on the replica count; the study reports the replicas the peak-hour rate needs "
                            "(replicas_for_peak)")
            continue
        if knob not in KNOBS:
            problems.append(f"unknown knob {knob!r} (knobs: {', '.join(KNOBS)})")
            continue
        if isinstance(spec, list):
            if not spec:
                problems.append(f"{knob}: an empty list of values")
                continue
            if len({repr(v) for v in spec}) != len(spec):
                problems.append(f"{knob}: repeated values")
                continue
            if any(isinstance(v, (dict, list)) for v in spec):
                problems.append(f"{knob}: values must be numbers, strings or booleans")
                continue
            knobs[knob] = list(spec)
        elif isinstance(spec, Mapping):
            extra = set(spec) - {"low", "high", "log", "step"}
            low, high = spec.get("low"), spec.get("high")
            numeric = (float, int) if knob in FLOAT_KNOBS else (int,)
            if extra:
                problems.append(f"{knob}: unknown range keys {', '.join(sorted(extra))} (low, high, log, step)")
            elif knob in BOOL_KNOBS or knob in ("kv_cache_dtype", "speculative_method", "scheduling_policy"):
                problems.append(f"{knob}: give a list of values, not a range")
            elif not all(isinstance(v, numeric) and not isinstance(v, bool) and math.isfinite(v)
                         for v in (low, high)):
                problems.append(f"{knob}: low and high must be {'numbers' if knob in FLOAT_KNOBS else 'integers'}")
            elif low > high:
                problems.append(f"{knob}: low ({low}) is above high ({high})")
            elif spec.get("log") and low <= 0:
                problems.append(f"{knob}: a log range needs low > 0")
            else:
                knobs[knob] = {k: spec[k] for k in ("low", "high", "log", "step") if k in spec}
        else:
            problems.append(f"{knob}: give a list of values or a range {{low, high}}, not {spec!r}")
    if problems:
        raise SpaceError(problems)
    space = Space(knobs, speculative_model)
    for knob, spec in knobs.items():
        values = [spec["low"], spec["high"]] if isinstance(spec, Mapping) else spec
        for value in values:
            problem = _value_problem(space, current, knob, value)
            if problem:
                problems.append(problem)
    if not any((isinstance(s, list) and len(s) > 1) or (isinstance(s, Mapping) and s["high"] > s["low"])
               for s in knobs.values()):
        problems.append("the search space is empty: give at least one knob with two or more values")
    if problems:
        raise SpaceError(problems)
    return space


def _value_problem(space: Space, current: EngineConfig, knob: str, value: Any) -> str | None:
    """Why vLLM refuses ``knob = value`` whatever the other knobs are (None when it can be valid)."""
    if knob == "speculative_method":
        if value != "none" and value not in SPECULATIVE_METHODS:
            return f"speculative_method: {value!r} is not one of none, {', '.join(SPECULATIVE_METHODS)}"
        if value in DRAFT_MODEL_METHODS and not space.speculative_model:
            return f"speculative_method: {value!r} drafts with a model: give speculative_model"
        return None
    if knob == "num_speculative_tokens":
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 16:
            return f"num_speculative_tokens: {value!r} is not an integer in 1..16"
        return None
    # Alone on a permissive base (chunked prefill on, budget large), so only the value itself can be refused.
    base = current.replace(enable_chunked_prefill=True, max_num_partial_prefills=1, max_long_partial_prefills=1,
                           max_num_seqs=1, max_num_batched_tokens=max(65536, current.resolved().max_model_len or 0),
                           long_prefill_token_threshold=0)
    try:
        base.replace(**{knob: value})
    except ConfigError as exc:
        mine = [p for p in exc.problems if p.startswith(knob) or f"({value})" in p]
        if mine:
            return f"{knob}: {value!r} is refused by vLLM: {mine[0]}"
    except TypeError as exc:
        return f"{knob}: {value!r}: {exc}"
    return None


def check(space: Space, current: EngineConfig, point: Mapping[str, Any], hardware=None, model=None) \
        -> tuple[EngineConfig | None, list[str]]:
    """The config of ``point`` and [] when vLLM would start it here, else None and the reasons (no simulation)."""
    try:
        config = space.config(current, point)
    except ConfigError as exc:
        return None, list(exc.problems)
    try:
        EngineCore(config, hardware=hardware, model=model)  # the memory plan: weights, activations, KV cache
    except (SimulationConfigError, ConfigError, ValueError) as exc:
        return None, [str(exc)]
    return config, []


def distance(a: EngineConfig, b: EngineConfig) -> int:
    """How many knobs differ between two configs (resolved values)."""
    return len(a.resolved().diff(b.resolved()))
