"""Speculative decoding in the simulator: how many drafted tokens are accepted, and what drafting costs.

Acceptance is described as vLLM's ``vllm:spec_decode_num_accepted_tokens_per_pos``
reports it: the fraction of drafts whose token at position i (1-based) was accepted.
Verification accepts a prefix, so position i can only be accepted if i-1 was; the
sampler draws position i with probability ``rate[i] / rate[i-1]`` from a seeded RNG.

The default rates are typical values for chat traffic (ShareGPT/MT-Bench-like) and
are uncertain by ±0.1 or more: acceptance depends heavily on the workload
(summarisation and code editing accept far more n-gram/suffix drafts than chat)
and on the draft head's training. Override them with ``SimOptions.acceptance_rates``.

Drafting cost per step: n-gram and suffix drafting run on the CPU (a small cost per
request); EAGLE, EAGLE-3 and MTP run a one-layer head ``k`` times in sequence
(EAGLE-3 with its reduced 32k draft vocabulary); Medusa runs ``k`` heads once; a
draft model runs its whole network ``k`` times. Verification needs no extra pass:
the target scores the ``k`` drafted tokens in the same step (they are extra tokens
in the step's roofline).
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from engine.config import SpeculativeConfig
from engine.sim.cost_model import StepCostModel
from engine.sim.profiles import HardwareProfile, ModelProfile, draft_model_profile

# Unconditional per-position acceptance (position 1 first); later positions continue the last ratio.
# eagle and eagle3 are measured: vLLM issue #20780 (July 2025) reports mean acceptance lengths on MT-Bench
# for Llama-3.1-8B-Instruct at k = 2..7 (EAGLE-1: 2.10, 2.29, 2.39, 2.43, 2.45, 2.47; EAGLE-3: 2.36,
# 2.79, 3.08, 3.32, 3.46, 3.54); the difference between consecutive k is the rate of the added position,
# and positions 1-2 are split in the ratio of positions 2-3. The others are typical published values.
DEFAULT_ACCEPTANCE_RATES: dict[str, tuple[float, ...]] = {
    # Prompt lookup rarely finds a match in open-ended chat; far higher on summarisation/RAG.
    "ngram": (0.25, 0.15, 0.10, 0.07, 0.05),
    # A 1B draft for an 8B/70B target of the same family.
    "draft_model": (0.70, 0.50, 0.36, 0.26, 0.19),
    "eagle": (0.66, 0.44, 0.19, 0.10, 0.04, 0.02, 0.02),
    "eagle3": (0.78, 0.58, 0.43, 0.29, 0.24, 0.14, 0.08),
    # Multi-token-prediction layers trained with the model (DeepSeek-V3 reports 85-90% for the 1st token).
    "mtp": (0.85, 0.70, 0.57, 0.46, 0.37),
    # Medusa heads predict independently of each other, so deep positions fall off fast.
    "medusa": (0.55, 0.30, 0.17, 0.09, 0.05),
    # Suffix decoding (Arctic Inference) shines on repetitive agentic traffic; moderate on chat.
    "suffix": (0.45, 0.35, 0.28, 0.23, 0.19),
}

# Methods whose proposer keeps a KV cache and needs lookahead slots (vLLM's use_eagle()/uses_draft_model()).
LOOKAHEAD_METHODS = frozenset({"eagle", "eagle3", "mtp", "draft_model"})

# CPU drafting cost per request per step, and a fixed cost per step, for the model-free proposers (seconds).
_CPU_DRAFT_COST = {"ngram": (4e-6, 30e-6), "suffix": (10e-6, 50e-6)}
# Fitted (engine/sim/calibration.py, vLLM issue #20780): fixed cost of one draft forward pass (launches,
# sampling the draft token, bookkeeping) on top of its roofline, and fixed cost per step of verifying
# drafts (rejection sampler, draft-token bookkeeping; EAGLE-3 also exports three hidden layers). Methods
# without their own measurement borrow EAGLE-1's figures.
DRAFT_PASS_OVERHEAD = {"eagle": 0.2e-3, "eagle3": 0.65e-3}
VERIFY_OVERHEAD = {"eagle": 0.65e-3, "eagle3": 1.1e-3}
EAGLE3_DRAFT_VOCAB = 32000


def acceptance_rates(method: str, num_speculative_tokens: int,
                     override: Sequence[float] | None = None) -> tuple[float, ...]:
    """Per-position acceptance for ``num_speculative_tokens`` positions (validated, non-increasing)."""
    base = tuple(override) if override is not None else DEFAULT_ACCEPTANCE_RATES[method]
    if not base:
        raise ValueError("acceptance_rates must list at least one rate")
    for rate in base:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rates must be numbers in [0, 1], not {rate!r}")
    for earlier, later in zip(base, base[1:]):
        if later > earlier + 1e-12:
            raise ValueError(
                f"acceptance rates must not increase with position (a token is only accepted after the ones "
                f"before it): {list(base)}"
            )
    rates = list(base[:num_speculative_tokens])
    while len(rates) < num_speculative_tokens:
        if len(rates) >= 2 and rates[-2] > 0:
            rates.append(rates[-1] * (rates[-1] / rates[-2]))
        else:
            rates.append(rates[-1])
    return tuple(float(rate) for rate in rates)


def mean_accepted(rates: Sequence[float]) -> float:
    """Expected accepted drafts per verification (the sum of per-position rates)."""
    return float(sum(rates))


class AcceptanceSampler:
    """Draws how many leading drafted tokens the target accepts, from a seeded RNG."""

    def __init__(self, rates: Sequence[float], seed: int = 0):
        self.rates = tuple(rates)
        previous = 1.0
        conditional = []
        for rate in self.rates:
            conditional.append(0.0 if previous <= 0 else min(1.0, rate / previous))
            previous = rate
        self._conditional = tuple(conditional)
        self._rng = random.Random(seed)

    def draw(self, num_drafts: int) -> int:
        """Accepted count in [0, num_drafts] for one request's drafts."""
        accepted = 0
        random_ = self._rng.random
        for probability in self._conditional[:num_drafts]:
            if probability >= 1.0 or (probability > 0.0 and random_() < probability):
                accepted += 1
            else:
                break
        return accepted


class DraftCostModel:
    """Seconds the proposer spends per step drafting ``k`` tokens for a batch of requests."""

    def __init__(self, config: SpeculativeConfig, target: ModelProfile, hardware: HardwareProfile, *,
                 tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto"):
        self.method = config.method
        self.k = config.num_speculative_tokens
        self.verify_overhead = VERIFY_OVERHEAD.get(self.method, VERIFY_OVERHEAD["eagle"])
        self._cpu = _CPU_DRAFT_COST.get(self.method)
        self._passes = 0
        self._pass_model: StepCostModel | None = None
        if self._cpu is not None:
            return
        if self.method == "draft_model":
            draft = draft_model_profile(config.model)
            self._passes = self.k
        elif self.method == "medusa":
            draft = _head_profile(target, layers=0, vocab=target.vocab_size, heads=self.k)
            self._passes = 1
        else:
            vocab = EAGLE3_DRAFT_VOCAB if self.method == "eagle3" else target.vocab_size
            draft = _head_profile(target, layers=1, vocab=vocab, fuse_features=self.method == "eagle3")
            self._passes = self.k
        self.draft_profile = draft
        self._pass_model = StepCostModel(
            draft, hardware, tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype,
            fixed_overhead=DRAFT_PASS_OVERHEAD.get(self.method, DRAFT_PASS_OVERHEAD["eagle"]),
        )

    def time(self, num_requests: int, first_pass_tokens: int, context_sum: float) -> float:
        """Drafting time for ``num_requests`` requests whose contexts total ``context_sum`` tokens.

        ``first_pass_tokens``: the first draft pass re-reads every token accepted in this
        step (1 + accepted per request); later passes feed one token per request.
        """
        if num_requests <= 0:
            return 0.0
        if self._cpu is not None:
            per_request, fixed = self._cpu
            return fixed + per_request * num_requests
        model = self._pass_model
        first = model.pass_time(first_pass_tokens, num_requests, context_sum, context_sum)
        if self._passes <= 1:
            return first
        later = model.pass_time(num_requests, num_requests, context_sum, context_sum)
        return first + (self._passes - 1) * later


def _head_profile(target: ModelProfile, *, layers: int, vocab: int, heads: int = 1,
                  fuse_features: bool = False) -> ModelProfile:
    """A draft head sized from the target: ``layers`` decoder layers (or ``heads`` Medusa heads) and an LM head."""
    h = target.hidden_size
    if layers:
        layer = target.attention_params_per_layer + 3 * h * target.intermediate_size
        body = layers * layer + (3 * h * h if fuse_features else 2 * h * h)  # feature fusion / input projection
        lm_heads = vocab * h
    else:  # Medusa: each head is a residual block (h x h) with its own LM head
        body = heads * h * h
        lm_heads = heads * vocab * h
    total = body + lm_heads
    return ModelProfile(
        name=f"{target.name}#draft-head",
        num_layers=max(layers, 1),
        hidden_size=h,
        num_attention_heads=target.num_attention_heads if layers else 1,
        num_kv_heads=target.num_kv_heads if layers else 1,
        head_dim=target.head_dim if layers else 0,
        intermediate_size=target.intermediate_size,
        vocab_size=vocab * heads if not layers else vocab,
        total_params=total,
        active_params=total,
        weight_dtype_bytes=target.weight_dtype_bytes,
        tie_word_embeddings=True,
    )
