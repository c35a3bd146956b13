"""The GPU kernel bench (engine/bench/gpu_kernels.py): its comparison and fit, and its passes run eagerly on a CPU.

No GPU here: the passes run on the CPU with the tiny test model (PyTorch from vLLM's virtualenv), which checks the
program a GPU host runs, not a GPU's figures. The comparison is checked on timings made by a roofline of known
constants.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench import gpu_kernels as bench
from engine.sim.profiles import hardware_profile, model_profile

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ROOT = Path(__file__).resolve().parents[2]


def _timings(truth) -> dict:
    """Every pass the bench times, each lasting what a roofline with ``truth``'s constants says."""
    cost = bench.roofline(model_profile(MODEL), truth)
    passes = [{"kind": "prefill", "tokens": n, "ms": 1e3 * cost.pass_time(*bench.pass_shape("prefill", n, 0, 0))}
              for n in bench.PREFILL_TOKENS]
    passes += [{"kind": "decode", "batch": b, "context": c,
                "ms": 1e3 * cost.pass_time(*bench.pass_shape("decode", 0, b, c))} for b, c in bench.DECODE_SHAPES]
    return {"model": MODEL, "gpu_type": "H200", "device": "roofline", "torch": "-", "passes": passes}


def _bench_lines(lines: list[str]) -> dict[str, float]:
    return {line.split()[1].split("=")[0]: float(line.split("=")[1].split()[0])
            for line in lines if line.startswith("BENCH ")}


def test_the_comparison_is_exact_on_the_profiles_own_roofline_and_its_fit_recovers_other_constants():
    h200 = hardware_profile("H200")
    figures = _bench_lines(bench.compare(_timings(h200)))
    assert figures["gpu_kernels_roofline_error_max_pct"] == pytest.approx(0.0, abs=0.05)

    truth = dataclasses.replace(h200, mfu=0.61, bandwidth_efficiency=0.88, serial_fraction=0.30)
    figures = _bench_lines(bench.compare(_timings(truth)))
    assert figures["gpu_kernels_roofline_error_max_pct"] > 10  # the profile's 0.42 / 0.80 / 0.85 are far off
    assert figures["gpu_kernels_fitted_mfu"] == pytest.approx(0.61, rel=0.02)
    assert figures["gpu_kernels_fitted_bandwidth_efficiency"] == pytest.approx(0.88, rel=0.02)
    assert figures["gpu_kernels_fitted_serial_fraction"] == pytest.approx(0.30, abs=0.03)
    # The implied figures read the longest prefill (compute-bound) and the batch-1 decode step (memory-bound).
    assert figures["gpu_kernels_prefill_mfu"] == pytest.approx(0.61, rel=0.15)
    assert figures["gpu_kernels_decode_bandwidth_efficiency"] == pytest.approx(0.88, rel=0.15)


def test_an_unknown_gpu_type_is_refused_before_any_work():
    with pytest.raises(Exception, match="no hardware profile for GPU type 'B300'"):
        bench.main(["--gpu-type", "B300", "--device", "cpu"])


@pytest.mark.mode_independent(suite="embedded")
def test_the_passes_run_eagerly_on_a_cpu_and_their_timings_compare_again_from_the_file(
        real_vllm_python, tiny_model_dir, tmp_path):
    saved = tmp_path / "timings.json"
    measured = subprocess.run(
        [real_vllm_python, "-m", "engine.bench.gpu_kernels", "--device", "cpu", "--model", tiny_model_dir,
         "--gpu-type", "CPU", "--quick", "--repeats", "2", "--json", str(saved)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert measured.returncode == 0, measured.stdout + measured.stderr
    result = json.loads(saved.read_text())
    assert [p["kind"] for p in result["passes"]] == ["prefill", "prefill", "decode", "decode"]
    assert all(p["ms"] > 0 for p in result["passes"]) and result["device"] == "CPU"
    assert "BENCH gpu_kernels_roofline_error_max_pct=" in measured.stdout
    again = subprocess.run([sys.executable, "-m", "engine.bench.gpu_kernels", "--from-json", str(saved)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    # The same comparison, and with SciPy (this virtualenv) the fitted constants as well.
    assert _bench_lines(again.stdout.splitlines())["gpu_kernels_roofline_error_max_pct"] == \
        _bench_lines(measured.stdout.splitlines())["gpu_kernels_roofline_error_max_pct"]
    assert "BENCH gpu_kernels_fitted_mfu=" in again.stdout
