"""A tuning study on a group of real vLLM replicas (vLLM's CPU build, `make vllm`, serving the test-size tiny
Llama with max_num_seqs 2, a poor config under a few requests at once): the study searches in the simulator's CPU
profile, and its confirmation replays the winner and the current config on real `vllm serve` processes the
regression run starts for itself (the launcher's command, every knob on its argv), measured from vLLM's own
llm_request spans.

Not in CI: the module starts three real vLLM processes (the group's, then one per arm of the confirmation, replayed
in turn) and takes a few minutes. Run it with OBSERVATORY_REAL_VLLM_TUNING=1 (and make vllm)."""
from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("OBSERVATORY_REAL_VLLM_TUNING") != "1",
                                reason="a few minutes on 2 cores: run with OBSERVATORY_REAL_VLLM_TUNING=1 (and make vllm)")


def test_a_study_on_real_vllm_is_confirmed_on_real_vllm(vllm_live, tmp_path):
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"max_num_seqs": [2, 4, 8, 16, 32]}))
    out = tmp_path / "study.json"
    rc, text = vllm_live.cli("tune", "--project", "default", "--group", "real", "--workload", "synthetic:code",
                             "--trials", "5", "--space", str(space), "--slo", "ttft_ms=2000", "--slo", "tpot_ms=200",
                             "--target", "0.9", "--json", str(out), timeout=900)
    assert rc == 0, text + vllm_live.process.log_tail()
    result = json.loads(out.read_text())
    assert result["current"]["config"]["max_num_seqs"] == 2 and result["current"]["config"]["gpu_type"] == "CPU"
    best = result["best"]
    assert best["config"]["max_num_seqs"] > 2 and best["goodput"] > result["current"]["goodput"], result
    confirmation = result["confirmation"]
    assert confirmation["state"] == "done" and confirmation["backend"] == "vllm", confirmation
    assert "real vLLM" in confirmation["note"]
    measured = confirmation["measured"]
    status, run = vllm_live.api("GET", f"/api/v1/regression-runs/{confirmation['run_id']}")
    summary = run["summary"]
    # Prompts sized with the model's own tokenizer fit max_model_len: real vLLM refuses none of them.
    assert summary["candidate"]["errors"] == 0 and summary["baseline"]["errors"] == 0, summary
    assert measured["best"]["requests"] >= 40 and measured["current"]["requests"] >= 40, measured
    assert set(confirmation["predicted_attainment"]) == {"best", "current"} and "gap_best" in confirmation
    # The run replayed on real vLLM: both arms' targets say so, and its rows are vLLM's own spans, decomposed.
    assert run["target"]["backend"] == "vllm" and run["baseline_target"]["backend"] == "vllm", run
    assert run["options"]["arms"] == "in_turn"  # one vLLM server loaded at a time
    assert run["target"]["config"]["max_num_seqs"] == best["config"]["max_num_seqs"]
    assert run["summary"]["rows_found"] >= 80, run["summary"]
    status, results = vllm_live.api("GET", f"/api/v1/regression-runs/{confirmation['run_id']}/results")
    assert status == 200
    decomposed = [r for r in results["results"] if (r.get("metrics") or {}).get("prefill_ms") is not None]
    assert len(decomposed) >= 80, results["results"][:2]
    # The replays are listed once, the paired run first; the confirmed goodput is the best rate the winner met.
    steps = confirmation["steps"]
    assert steps[0]["run_id"] == confirmation["run_id"] and steps[0]["attainment"] == confirmation["best"], steps
    met = [step["rate"] for step in steps if step["met"]]
    assert confirmation.get("confirmed_goodput") == (max(met) if met else None) == best["confirmed_goodput"]
    rates = [step["rate"] for step in steps]
    # From the predicted goodput (capped at the fixture's TUNING_CONFIRM_MAX_RATE, 6) down; it stops once met.
    assert rates[0] == pytest.approx(min(best["goodput"], 6), rel=1e-3) and rates == sorted(set(rates), reverse=True)
    assert not any(step["met"] for step in steps[:-1]), steps
