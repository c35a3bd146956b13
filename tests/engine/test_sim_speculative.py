"""Speculative decoding in the simulator: tokens per step from the acceptance rates, costs, vLLM's counters."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.sim.core import EngineCore
from engine.sim.options import SimOptions
from engine.sim.request import SimRequest
from engine.sim.speculative import DEFAULT_ACCEPTANCE_RATES, AcceptanceSampler, acceptance_rates, mean_accepted

K = 4


def _engine(method="eagle3", rates=None, k=K) -> EngineCore:
    model = None if method in ("ngram", "suffix") else "draft"
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model=model) if method else None
    config = EngineConfig(max_model_len=4096, speculative_config=spec)
    return EngineCore(config, options=SimOptions(acceptance_rates=rates), seed=3)


def _run_one(engine: EngineCore, output: int) -> tuple[SimRequest, list[int], float]:
    request = SimRequest("r", 64, output, 0.0)
    engine.add_request(request, 0.0)
    per_step, now = [], 0.0
    while engine.has_unfinished_requests():
        out = engine.step(now)
        per_step.append(out.new_tokens.get("r", 0))
        now = out.end_time
    return request, per_step, now


def test_full_acceptance_emits_k_plus_one_tokens_per_step():
    engine = _engine(rates=(1.0,))
    request, per_step, _ = _run_one(engine, 1 + (K + 1) * 10)
    assert per_step[0] == 1  # the prefill step samples the first token
    assert per_step[1:] == [K + 1] * 10
    assert request.num_generated == 1 + (K + 1) * 10
    assert engine.spec_num_drafts == 10 and engine.spec_num_draft_tokens == 10 * K
    assert engine.spec_num_accepted_tokens == 10 * K
    assert engine.spec_num_accepted_tokens_per_pos == [10] * K


def test_zero_acceptance_emits_one_token_per_step_and_is_no_faster():
    spec_engine = _engine(rates=(0.0,))
    request, per_step, spec_end = _run_one(spec_engine, 40)
    assert per_step == [1] * 40
    assert spec_engine.spec_num_accepted_tokens == 0 and spec_engine.spec_num_draft_tokens == 39 * K
    _plain_request, _steps, plain_end = _run_one(_engine(method=None), 40)
    assert spec_end >= plain_end  # drafting and verification cost time and buy nothing


def test_the_last_step_does_not_overshoot_the_requested_output():
    request, per_step, _ = _run_one(_engine(rates=(1.0,)), 8)
    assert sum(per_step) == 8 == request.num_generated
    assert per_step == [1, K + 1, 2]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa", "suffix"])
def test_every_method_speeds_up_a_single_stream_with_its_default_rates(method):
    _request, _steps, plain = _run_one(_engine(method=None), 200)
    spec_request, _steps, with_spec = _run_one(_engine(method=method, k=3), 200)
    assert spec_request.num_generated == 200
    if method == "ngram":
        assert with_spec < plain * 1.05  # chat traffic gives prompt lookup little to work with
    else:
        assert with_spec < plain


def test_measured_acceptance_converges_to_the_configured_rates():
    rates = acceptance_rates("eagle3", K)
    sampler = AcceptanceSampler(rates, seed=11)
    draws = [sampler.draw(K) for _ in range(40_000)]
    assert sum(draws) / len(draws) == pytest.approx(mean_accepted(rates), rel=0.02)
    for position in range(K):
        share = sum(1 for accepted in draws if accepted > position) / len(draws)
        assert share == pytest.approx(rates[position], abs=0.01)


def test_acceptance_rates_are_validated_and_extended():
    assert acceptance_rates("eagle3", 2) == DEFAULT_ACCEPTANCE_RATES["eagle3"][:2]
    extended = acceptance_rates("ngram", 8)
    assert len(extended) == 8 and all(b <= a for a, b in zip(extended, extended[1:]))
    assert acceptance_rates("eagle", 3, override=(1.0,)) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="must not increase"):
        acceptance_rates("eagle", 2, override=(0.5, 0.7))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        acceptance_rates("eagle", 2, override=(1.5,))
    with pytest.raises(ValueError, match="at least one"):
        acceptance_rates("eagle", 2, override=())
