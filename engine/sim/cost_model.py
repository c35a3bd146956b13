"""How long one forward pass takes: a roofline over FLOPs and bytes moved, per GPU, plus fixed overheads.

Per step (per tensor-parallel rank):

- FLOPs: linear layers ``2 · active body params · tokens``, attention
  ``4 · layers · heads · head_dim`` per (query, key) pair, the LM head
  ``2 · hidden · vocab`` per position whose logits are computed;
- bytes: the weights once per step (for MoE only the experts the batch's tokens
  are routed to, assuming uniform routing), the KV cache of every scheduled
  request's context plus the KV written for the new tokens, and a small
  activation term;
- with C = FLOPs / (peak · MFU) and M = bytes / (bandwidth · efficiency),
  time = max(C, M) + serial_fraction · min(C, M)
  + fixed step overhead + per-layer overhead + tensor-parallel all-reduce
  (two per layer, ring cost on the interconnect plus a per-call latency).

A step is a sequence of kernels each bound by compute or by memory, so the two
do not overlap perfectly (``serial_fraction`` says how much does not). The form
stays piecewise linear in the context length, which keeps a run of decode steps
summable in closed form for the event-skipping fast path.
"""
from __future__ import annotations

import dataclasses
import math

from engine.sim.profiles import HardwareProfile, ModelProfile


def kv_dtype_bytes(kv_cache_dtype: str, model: ModelProfile) -> int:
    """Bytes per KV element: 1 for the fp8 variants, the model's dtype for auto/bfloat16."""
    if kv_cache_dtype.startswith("fp8"):
        return 1
    return 2 if kv_cache_dtype == "bfloat16" else model.weight_dtype_bytes


def kv_bytes_per_token_per_rank(model: ModelProfile, tp: int, dtype_bytes: int) -> int:
    """KV bytes one token takes on each GPU: KV heads are split across ranks (replicated when fewer than ranks)."""
    heads_per_rank = max(1, model.num_kv_heads // tp)
    return 2 * model.num_layers * heads_per_rank * model.head_dim * dtype_bytes


@dataclasses.dataclass(frozen=True)
class PassShape:
    """What a forward pass computes: scheduled tokens, logit positions, attention pairs, KV tokens read."""

    num_tokens: int
    num_logits: int
    attention_pairs: float
    kv_read_tokens: float


class StepCostModel:
    """Forward-pass time of one model on one hardware profile at a tensor-parallel degree."""

    def __init__(self, model: ModelProfile, hardware: HardwareProfile, *, tensor_parallel_size: int = 1,
                 kv_cache_dtype: str = "auto", fixed_overhead: float | None = None):
        tp = tensor_parallel_size
        self.model = model
        self.hardware = hardware
        self.tensor_parallel_size = tp
        wbytes = model.weight_dtype_bytes
        peak = hardware.fp8_flops if wbytes == 1 and hardware.fp8_flops else hardware.bf16_flops
        self._flops_rate = peak * hardware.mfu
        self._saturation = hardware.compute_saturation_tokens
        self._serial = hardware.serial_fraction
        self._byte_rate = hardware.hbm_bandwidth * hardware.bandwidth_efficiency
        self._flops_per_token = 2.0 * model.active_body_params / tp
        self._flops_per_logit = 2.0 * model.hidden_size * model.vocab_size / tp
        self._flops_per_pair = 4.0 * model.num_layers * model.num_attention_heads * model.head_dim / tp
        self.kv_bytes_per_token = kv_bytes_per_token_per_rank(model, tp, kv_dtype_bytes(kv_cache_dtype, model))
        # Residual stream in and out of each layer plus the norms' reads: small next to weights and KV.
        self._act_bytes_per_token = 4.0 * model.num_layers * model.hidden_size * 2
        self._dense_weight_bytes = (model.dense_body_params + model.lm_head_params) * wbytes / tp
        self._expert_bytes_per_layer = model.expert_params * wbytes / tp
        self._moe_touched: dict[int, float] = {}
        overhead = hardware.step_overhead if fixed_overhead is None else fixed_overhead
        self._fixed = overhead + model.num_layers * hardware.layer_overhead
        self._per_sequence = hardware.sequence_overhead
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp
            calls = 2 * model.num_layers
            self._fixed += calls * hardware.interconnect_latency
            self._comm_per_token = calls * ring * model.hidden_size * 2 / hardware.interconnect_bandwidth
        else:
            self._comm_per_token = 0.0

    # ------------------------------------------------------------------ one pass
    def weight_bytes(self, num_tokens: int) -> float:
        """Weight bytes read by a pass over ``num_tokens`` tokens (MoE: only the experts some token is routed to)."""
        if not self.model.is_moe:
            return self._dense_weight_bytes
        touched = self._moe_touched.get(num_tokens)
        if touched is None:
            experts, active = self.model.num_experts, self.model.num_active_experts
            touched = experts * (1.0 - (1.0 - active / experts) ** num_tokens)
            if len(self._moe_touched) < 65536:
                self._moe_touched[num_tokens] = touched
        return self._dense_weight_bytes + self.model.num_layers * touched * self._expert_bytes_per_layer

    def flops_rate(self, num_tokens: int) -> float:
        """FLOP/s a pass over ``num_tokens`` tokens reaches (lower for small passes when the profile says so)."""
        if self._saturation <= 0.0:
            return self._flops_rate
        return self._flops_rate * num_tokens / (num_tokens + self._saturation)

    def pass_flops(self, num_tokens: int, num_logits: int, attention_pairs: float) -> float:
        """The FLOPs a pass computes per rank, as pass_time counts them (which inlines this: it runs every step)."""
        return (num_tokens * self._flops_per_token + num_logits * self._flops_per_logit
                + attention_pairs * self._flops_per_pair)

    def pass_bytes(self, num_tokens: int, kv_read_tokens: float) -> float:
        """The bytes a pass moves per rank, as pass_time counts them (which inlines this)."""
        return (self.weight_bytes(num_tokens) + (kv_read_tokens + num_tokens) * self.kv_bytes_per_token
                + num_tokens * self._act_bytes_per_token)

    def pass_time(self, num_tokens: int, num_logits: int, attention_pairs: float, kv_read_tokens: float) -> float:
        """Seconds for one forward pass; zero tokens cost nothing."""
        if num_tokens <= 0:
            return 0.0
        compute = (
            num_tokens * self._flops_per_token
            + num_logits * self._flops_per_logit
            + attention_pairs * self._flops_per_pair
        ) / self.flops_rate(num_tokens)
        memory = (
            self.weight_bytes(num_tokens)
            + (kv_read_tokens + num_tokens) * self.kv_bytes_per_token
            + num_tokens * self._act_bytes_per_token
        ) / self._byte_rate
        if compute > memory:
            bound = compute + self._serial * memory
        else:
            bound = memory + self._serial * compute
        # One logit position per scheduled sequence (more only with speculative drafts): the per-sequence cost.
        return bound + self._fixed + num_tokens * self._comm_per_token + num_logits * self._per_sequence

    def shape_time(self, shape: PassShape) -> float:
        return self.pass_time(shape.num_tokens, shape.num_logits, shape.attention_pairs, shape.kv_read_tokens)

    # ------------------------------------------------------------------ runs of identical decode steps
    def _decode_coefficients(self, num_seqs: int, context_sum: float) -> tuple[float, float, float, float, float]:
        """Step k of a decode-only run costs max(ac + bc·k, am + bm·k) + const (contexts grow by num_seqs a step)."""
        n = num_seqs
        rate = self.flops_rate(n)
        ac = (n * self._flops_per_token + n * self._flops_per_logit + context_sum * self._flops_per_pair) / rate
        bc = n * self._flops_per_pair / rate
        am = (self.weight_bytes(n) + (context_sum + n) * self.kv_bytes_per_token + n * self._act_bytes_per_token) \
            / self._byte_rate
        bm = n * self.kv_bytes_per_token / self._byte_rate
        const = self._fixed + n * self._comm_per_token + n * self._per_sequence
        return ac, bc, am, bm, const

    def decode_step_time(self, num_seqs: int, context_sum: float) -> float:
        """One decode-only step: every sequence computes one token attending to its context (context_sum keys)."""
        return self.pass_time(num_seqs, num_seqs, context_sum, context_sum)

    def decode_run_time(self, num_seqs: int, context_sum: float, steps: int) -> float:
        """Total seconds of ``steps`` consecutive decode-only steps, the first at ``context_sum``, in closed form."""
        if steps <= 0 or num_seqs <= 0:
            return 0.0
        ac, bc, am, bm, const = self._decode_coefficients(num_seqs, context_sum)
        # The compute and memory lines cross at most once: sum each side's arithmetic series.
        diff, slope = ac - am, bc - bm  # step k is compute-bound when diff + slope·k > 0
        sf = self._serial
        # Compute-bound steps cost C + sf·M, memory-bound ones M + sf·C: both linear in k.
        ca, cb = ac + sf * am, bc + sf * bm
        ma, mb = am + sf * ac, bm + sf * bc
        if slope == 0.0:
            total = _series(ca, cb, 0, steps) if diff > 0 else _series(ma, mb, 0, steps)
        elif slope > 0:
            split = min(steps, max(0, math.floor(-diff / slope) + 1))
            total = _series(ma, mb, 0, split) + _series(ca, cb, split, steps)
        else:
            split = min(steps, max(0, math.ceil(-diff / slope)))
            total = _series(ca, cb, 0, split) + _series(ma, mb, split, steps)
        return total + steps * const

    def decode_steps_before(self, num_seqs: int, context_sum: float, horizon: float, max_steps: int) -> int:
        """How many consecutive decode steps start strictly before ``horizon`` seconds from the first start."""
        if max_steps <= 0 or horizon <= 0:
            return 0
        if self.decode_run_time(num_seqs, context_sum, max_steps - 1) < horizon:
            return max_steps
        low, high = 1, max_steps - 1  # the answer j: run_time(j - 1) < horizon <= run_time(j)
        while low < high:
            mid = (low + high) // 2
            if self.decode_run_time(num_seqs, context_sum, mid) < horizon:
                low = mid + 1
            else:
                high = mid
        return low


def _series(a: float, b: float, start: int, stop: int) -> float:
    """sum of a + b·k for k in [start, stop)."""
    count = stop - start
    if count <= 0:
        return 0.0
    return count * a + b * (start + stop - 1) * count / 2.0
