"""Calibration against published vLLM figures, profile lookups, and the closed-form decode series."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import GPU_TYPES, MODEL_MAX_LEN
from engine.sim.calibration import CALIBRATION_POINTS, point_named, run_calibration
from engine.sim.cost_model import StepCostModel
from engine.sim.profiles import (
    MODEL_PROFILES,
    UnknownProfileError,
    draft_model_profile,
    hardware_profile,
    model_profile,
)


@pytest.fixture(scope="module")
def calibration():
    return run_calibration()


def test_there_are_enough_documented_points_of_every_kind():
    assert len(CALIBRATION_POINTS) >= 4
    names = [p.name for p in CALIBRATION_POINTS]
    assert len(set(names)) == len(names)
    kinds = " ".join(names)
    for kind in ("decode_bs1", "throughput", "eagle", "under_load"):
        assert kind in kinds
    for point in CALIBRATION_POINTS:
        assert point.source.startswith("https://") and point.date and point.vllm_version and point.setup
        assert 0 < point.tolerance_pct <= 15 and point.measured > 0


def test_every_calibration_point_is_within_its_tolerance(calibration):
    for result in calibration:
        assert result.within_tolerance, (result.point.name, result.point.measured, result.simulated)


def test_point_lookup_names_the_known_points():
    assert point_named("eagle3_k4_llama8b_h100").measured == 4.05
    with pytest.raises(KeyError, match="decode_bs1_llama8b_h100"):
        point_named("nope")


def test_every_configurable_gpu_and_model_has_a_profile():
    for gpu in GPU_TYPES:
        profile = hardware_profile(gpu)
        assert profile.name == gpu and 0 < profile.mfu < 1 and 0 < profile.bandwidth_efficiency < 1
    for name in MODEL_MAX_LEN:
        assert model_profile(name).name == name


def test_unknown_profiles_are_clear_errors():
    with pytest.raises(UnknownProfileError, match="known: H100"):
        hardware_profile("TPU-v5")
    with pytest.raises(UnknownProfileError, match="Llama-3.1-8B"):
        model_profile("gpt2")
    assert draft_model_profile("someone/unknown-draft").num_layers == 16  # documented 1B fallback


def test_model_profiles_are_consistent_with_their_parameter_counts():
    for profile in MODEL_PROFILES.values():
        layers = profile.num_layers
        body = profile.attention_params_per_layer * layers
        if profile.is_moe:
            body += layers * profile.num_experts * profile.expert_params
        else:
            body += layers * 3 * profile.hidden_size * profile.intermediate_size
        assert body + profile.embedding_params == pytest.approx(profile.total_params, rel=0.03), profile.name
    moe = model_profile("Qwen/Qwen3-30B-A3B")
    active = moe.dense_body_params + moe.num_layers * moe.num_active_experts * moe.expert_params
    assert active + moe.embedding_params == pytest.approx(moe.active_params, rel=0.05)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.1-70B-Instruct"]),
    st.sampled_from(["H100", "A100-80GB", "L4"]),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 1024),
    st.integers(1, 4000),
    st.integers(1, 3000),
)
def test_closed_form_decode_runs_equal_the_sum_of_their_steps(model, gpu, tp, seqs, context, steps):
    cost = StepCostModel(model_profile(model), hardware_profile(gpu), tensor_parallel_size=tp)
    start = seqs * context
    expected = sum(cost.decode_step_time(seqs, start + k * seqs) for k in range(steps))
    assert cost.decode_run_time(seqs, start, steps) == pytest.approx(expected, rel=1e-9)
    horizon = expected / 2
    count = cost.decode_steps_before(seqs, start, horizon, steps)
    # exactly the steps that start before the horizon
    assert cost.decode_run_time(seqs, start, count - 1) < horizon
    if count < steps:
        assert cost.decode_run_time(seqs, start, count) >= horizon


def test_a_hosts_fitted_cpu_constants_replace_the_committed_ones_when_named(tmp_path, monkeypatch):
    import json
    import os

    from engine.sim.profiles import CPU_CONSTANTS_ENV, UnknownProfileError, hardware_profile

    committed = hardware_profile("CPU")
    gpus_before = {gpu: dataclasses.asdict(hardware_profile(gpu)) for gpu in GPU_TYPES if gpu != "CPU"}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"mfu": 0.25, "api_token_overhead": 4.7e-4, "api_core_share": 0.9}))
    monkeypatch.setenv(CPU_CONSTANTS_ENV, str(path))
    host = hardware_profile("CPU")
    assert (host.mfu, host.api_token_overhead, host.api_core_share) == (0.25, 4.7e-4, 0.9)
    assert host.bandwidth_efficiency == committed.bandwidth_efficiency  # the others stay
    # Only the CPU profile: every GPU's is what it was before the file was named.
    assert {gpu: dataclasses.asdict(hardware_profile(gpu)) for gpu in gpus_before} == gpus_before
    for bad, words in [({"mfu": "fast"}, "mfu must be a finite number"),
                       ({"api_core_share": "half"}, "api_core_share must be a finite number"),
                       ({"warp_speed": 9}, "unknown constants warp_speed"),
                       ({"api_core_share": 1.0}, "below 1"), ([1, 2], "not a JSON object")]:
        path.write_text(json.dumps(bad))
        os.utime(path, (1, len(words)))  # a new modification time: read again
        with pytest.raises(UnknownProfileError, match=words):
            hardware_profile("CPU")
    monkeypatch.setenv(CPU_CONSTANTS_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(UnknownProfileError, match="cannot read"):
        hardware_profile("CPU")
