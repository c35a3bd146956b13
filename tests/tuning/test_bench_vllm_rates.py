"""The real-vLLM calibration bench sizes its traffic to the host (platform/tuning/bench_vllm.py): its rates scale
down by the group's measured capacity, never up. (The bench itself runs real vLLM for tens of minutes: make bench-vllm,
or the opt-in tests/tuning/test_evaluation_real_vllm.py.)"""
from __future__ import annotations

import math

import pytest
from tuning import bench_vllm


def test_rates_scale_down_by_the_capacity_the_probe_measured_and_never_up():
    reference = bench_vllm.REFERENCE_CAPACITY
    assert bench_vllm.rate_scale(reference / 4) == pytest.approx(0.25)
    assert bench_vllm.rate_scale(reference) == 1.0
    assert bench_vllm.rate_scale(reference * 3) == 1.0
    for nothing in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(RuntimeError, match="served nothing"):
            bench_vllm.rate_scale(nothing)


def test_a_scaled_load_keeps_its_seed_and_lengths_and_says_its_rate():
    load = bench_vllm.TRAINING[0]
    half = load.scaled(0.5)
    assert (half.rate, half.seed, half.input_len, half.output_len) == (load.rate / 2, load.seed, load.input_len,
                                                                      load.output_len)
    assert half.argv("127.0.0.1:1", 60)[half.argv("127.0.0.1:1", 60).index("--rate") + 1] == str(load.rate / 2)
    assert f"scaled to {load.rate / 2:.2f} req/s" in half.what
    assert load.scaled(1.0) is load


def test_a_rate_scale_that_is_not_a_positive_number_is_refused(capsys):
    for bad in ("0", "-0.5", "nan", "fast"):
        with pytest.raises(SystemExit):
            bench_vllm.main(["--rate-scale", bad])
        assert "--rate-scale" in capsys.readouterr().err
