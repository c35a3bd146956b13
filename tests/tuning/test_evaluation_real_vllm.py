"""An engine model calibrated from the traffic real vLLM served (vLLM's CPU build, `make vllm`, serving the study-size
tiny Llama behind the gateway), predicting two held-out workloads it never saw, another rate and another length mix,
each served twice; asserted against real vLLM's own noise measured in the same run (the bench tuning/bench_vllm.py,
shortened: 3 minutes of traffic, held-out runs of 60 s).

Not in CI: a platform, a real vLLM and about 9 minutes of traffic on two shared cores, where CI's 45-minute budget
has no room left (`make bench-vllm` runs the full 10-minute version). Run it with OBSERVATORY_REAL_VLLM_CALIBRATION=1
(and make vllm)."""
from __future__ import annotations

import os

import pytest
from tuning import bench_vllm

from engine import tiny_model

pytestmark = [
    pytest.mark.skipif(os.environ.get("OBSERVATORY_REAL_VLLM_CALIBRATION") != "1",
                       reason="~9 minutes of real vLLM on 2 cores: run with OBSERVATORY_REAL_VLLM_CALIBRATION=1 (and "
                              "make vllm)"),
    pytest.mark.one_suite(suite="embedded"),
]
# How many figures (of a workload's 12: six figures on each of two runs) the model may get within 20 % fewer than
# real vLLM against itself. That count moved by up to 1 between the two workloads of a run where both were served
# alike (7 and 6 of 12; 10 and 10; by 6 where one saturated the group: 2 and 8), so a model one figure short is within
# the count's own noise, and two leaves a figure of margin. With vLLM's model on two threads the model was further
# short, on a quiet host too; on one thread (the launcher's default on 2 cores) the bench gave the model 11 and 12 of
# 12 against real vLLM's own 10 and 11 (docs/tuning.md#real-vllm-calibrated-from-its-own-traffic).
SLACK = 2


@pytest.fixture(scope="module")
def measured(real_vllm_executable, tmp_path_factory):
    model = tiny_model.build(tmp_path_factory.mktemp("tiny-study"), "study")
    lines: list[str] = []
    result = bench_vllm.run(minutes=3, heldout_seconds=60, model=str(model), executable=real_vllm_executable,
                            log=lines.append, study=False)
    bench_vllm.report(result, out=lines.append)
    print("\n".join(lines))
    return result, lines


def test_the_model_is_fitted_from_the_traffic_real_vllm_served(measured):
    result, lines = measured
    model = result["model"]
    assert model["state"] == "fitted" and model["base_profile"] == "CPU", model
    assert set(model["constants"]) == {"mfu", "bandwidth_efficiency", "step_overhead", "sequence_overhead"}
    assert model["fit_requests"] >= 200 and model["held_out_requests"] > 20, model
    assert any(line.startswith("BENCH vllm_traffic_model_heldout_within_20pct=") for line in lines)
    # Every held-out run reached the platform: its rows are replayed (the tiny model's gibberish now and then decodes
    # to no text at all, which the load generator counts as failed: 1 of 86 in a run).
    for workload in result["workloads"].values():
        for run in workload["runs"]:
            assert run["failed"] <= 0.03 * run["sent"] and run["model"]["requests"] >= 0.95 * run["sent"], run


def test_on_each_held_out_workload_the_model_is_about_as_close_as_real_vllm_to_itself(measured):
    """The issue's target, asserted as it is, per workload, less SLACK. Before the launcher left a core to the host,
    vLLM's two model threads moved its step times several-fold with the host's load (make bench-vllm: the model 4
    and 5 of 12 figures within 20 % against real vLLM's own 10 and 10); since, the bench's run gave 11 and 12
    against 10 and 11, and this test (2026-11-30, 8.3 min, idle host) 12 and 12 against 11 and 12."""
    result, lines = measured
    for name, sides in bench_vllm.counts(result).items():
        model, of = sides["model"]
        itself, _ = sides["itself"]
        assert of == (12 if name != "all" else 24), sides
        if name != "all":
            assert model >= itself - SLACK, (name, sides, "\n".join(lines))
