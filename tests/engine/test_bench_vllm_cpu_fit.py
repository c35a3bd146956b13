"""The CPU profile's fit (`python -m engine.bench.vllm_cpu --fit`): it finds constants that reproduce measurements,
and held-out configurations never enter it. The "measurements" here come from the simulator itself with known
constants, so the right answer is known."""
from __future__ import annotations

import pytest

from engine.bench import vllm_cpu
from engine.launcher.cli import main
from engine.sim.profiles import hardware_profile


@pytest.fixture(scope="module")
def study_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-study"
    assert main(["tiny-model", str(path), "--size", "study"]) == 0
    return str(path)


def test_the_fit_recovers_known_constants_and_ignores_held_out_points(study_model, capsys):
    truth = hardware_profile("CPU").with_constants(mfu=0.3, api_event_overhead=4e-4)
    fit_points = [p for p in vllm_cpu.GRID if p.name in ("fit-light", "fit-burst")]
    held_out = next(p for p in vllm_cpu.GRID if p.name == "seqs-64-burst")
    measured = {p.name: vllm_cpu.run_simulated(p, vllm_cpu.config_for(p, study_model), truth) for p in fit_points}
    # A held-out measurement far from anything the truth produces: were it in the fit, it would pull the constants.
    real = vllm_cpu.run_simulated(held_out, vllm_cpu.config_for(held_out, study_model), truth)
    measured[held_out.name] = vllm_cpu.RunFigures(real.ttft_ms, real.tpot_ms, real.output_throughput * 5,
                                                  real.mean_queue_ms, real.preemptions)
    # Every constant but two is held at the committed profile's value; the two start far from the truth.
    committed = hardware_profile("CPU")
    fixed = {name: getattr(committed, name) for name in vllm_cpu.FITTED if name not in ("mfu", "api_event_overhead")}
    fitted = vllm_cpu.fit_cpu_profile(measured, study_model, generations=8, fixed=fixed)
    assert "differential evolution" in capsys.readouterr().out
    assert fitted.mfu == pytest.approx(0.3, rel=0.1)
    assert fitted.api_event_overhead == pytest.approx(4e-4, rel=0.25)
    for name, value in fixed.items():
        assert getattr(fitted, name) == value
