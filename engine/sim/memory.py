"""GPU memory planning as vLLM does it at start-up: what is left for the KV cache after weights and activations.

vLLM profiles a forward pass at ``max_num_batched_tokens`` and a sampler pass at
``max_num_seqs``, then gives ``gpu_memory_utilization · memory − weights − peak
activations − non-torch memory`` to the KV cache. The simulator estimates the
activation peak from the model's widths instead of measuring it; the estimate is
within a few percent of the "GPU KV cache size" vLLM logs for Llama-3.1-8B on an
H100 (about 440-460k tokens at the defaults).
"""
from __future__ import annotations

import dataclasses

from engine.config import EngineConfig
from engine.sim.cost_model import kv_bytes_per_token_per_rank, kv_dtype_bytes
from engine.sim.profiles import GIB, HardwareProfile, ModelProfile, draft_model_profile

# CUDA context, cuBLAS/cuDNN workspaces and CUDA-graph pools: outside PyTorch's allocator.
NON_TORCH_BYTES = 1.0 * GIB
# NCCL buffers and vLLM's custom all-reduce workspace when tensor parallel.
TP_COMM_BYTES = 0.3 * GIB


class SimulationConfigError(ValueError):
    """A configuration vLLM would refuse to start with on this hardware (weights or a full context do not fit)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory split (bytes) and the resulting KV block count."""

    budget_bytes: float  # gpu_memory_utilization · memory
    weight_bytes: float  # target (+ draft) weights per GPU
    activation_bytes: float  # profiled peak activations, sampler and non-torch memory
    kv_cache_bytes: float
    kv_bytes_per_token: int  # per GPU, target (+ draft) layers
    num_blocks: int

    @property
    def kv_cache_tokens(self) -> int:
        return int(self.kv_cache_bytes // self.kv_bytes_per_token)


def draft_weight_and_kv(config: EngineConfig, target: ModelProfile, tp: int, kv_bytes: int) -> tuple[float, int]:
    """Extra weight bytes and KV bytes per token (per GPU) that the speculative proposer adds."""
    spec = config.speculative_config
    if spec is None or spec.method in ("ngram", "suffix"):
        return 0.0, 0
    if spec.method == "draft_model":
        draft = draft_model_profile(spec.model)
        return draft.weight_bytes / tp, kv_bytes_per_token_per_rank(draft, tp, kv_bytes)
    h = target.hidden_size
    if spec.method == "medusa":
        heads = spec.num_speculative_tokens
        return heads * (h * h + target.vocab_size * h) * target.weight_dtype_bytes / tp, 0
    # EAGLE / EAGLE-3 / MTP: one decoder layer (own KV) plus an input projection; the LM head is shared
    # with the target for EAGLE/MTP, EAGLE-3 brings a 32k-vocabulary head of its own.
    layer = target.attention_params_per_layer + 3 * h * target.intermediate_size + 3 * h * h
    if spec.method == "eagle3":
        layer += 32000 * h
    per_token_kv = 2 * max(1, target.num_kv_heads // tp) * target.head_dim * kv_bytes
    return layer * target.weight_dtype_bytes / tp, per_token_kv


def plan_memory(config: EngineConfig, model: ModelProfile, hardware: HardwareProfile) -> MemoryPlan:
    """Size the KV cache for a resolved config; raises SimulationConfigError where vLLM would fail to start."""
    tp = config.tensor_parallel_size
    kv_bytes = kv_dtype_bytes(config.kv_cache_dtype, model)
    per_token = kv_bytes_per_token_per_rank(model, tp, kv_bytes)
    draft_weights, draft_kv = draft_weight_and_kv(config, model, tp, kv_bytes)
    per_token += draft_kv
    budget = hardware.memory_bytes * config.gpu_memory_utilization
    weights = model.weight_bytes / tp + draft_weights
    ffn_width = model.intermediate_size * (model.num_active_experts if model.is_moe else 1)
    activations = (
        config.max_num_batched_tokens * (2 * ffn_width / tp + 6 * model.hidden_size) * 2
        + config.max_num_seqs * model.vocab_size * 8  # fp32 logits and probabilities of the sampler warm-up
        + NON_TORCH_BYTES
        + (TP_COMM_BYTES if tp > 1 else 0.0)
    )
    if config.kv_cache_memory_bytes is not None:
        # vLLM's --kv-cache-memory-bytes sizes the cache directly and skips the utilisation plan (the CPU build's
        # way of sizing it, too).
        kv_cache = float(config.kv_cache_memory_bytes)
        num_blocks = int(kv_cache // (per_token * config.block_size))
        return MemoryPlan(kv_cache + weights + activations, weights, activations, kv_cache, per_token, num_blocks)
    kv_cache = budget - weights - activations
    if kv_cache <= 0:
        raise SimulationConfigError(
            f"{model.name} needs {weights / GIB:.1f} GiB of weights and ~{activations / GIB:.1f} GiB of activations "
            f"per GPU but gpu_memory_utilization={config.gpu_memory_utilization} of a {hardware.name} "
            f"gives {budget / GIB:.1f} GiB: no memory is left for the KV cache (raise tensor_parallel_size or "
            f"gpu_memory_utilization, or lower max_num_batched_tokens/max_num_seqs)"
        )
    num_blocks = int(kv_cache // (per_token * config.block_size))
    return MemoryPlan(budget, weights, activations, kv_cache, per_token, num_blocks)
