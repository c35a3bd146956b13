"""Rollouts against real vLLM replicas (its CPU build, `make vllm`, serving the test-size tiny Llama): the canary
group is a real `vllm serve` started by the fleet controller at run time; one rollout is rolled back (max_num_seqs
1 under a load the group serves with 8), one promoted (the group is drained and replaced by real replicas with the
new config). The verdicts come from vLLM's own llm_request spans (queue, prefill, decode). Skipped without vLLM
unless OBSERVATORY_REQUIRE_VLLM=1.

The canary is compared with its baseline twin (a third real vLLM process: the group's config, as much traffic).

Not in CI: on this 2-core host the module takes ~10 minutes (each real replica starts in a minute or two beside a
loaded one; the promotion's drain-and-replace starts another), more than the CI budget allows beside the rest. Run it
with OBSERVATORY_REAL_VLLM_ROLLOUTS=1 (measured here 2026-11-26, with the twin: rollback 181 s, promotion 338 s,
module 9.5 min)."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("OBSERVATORY_REAL_VLLM_ROLLOUTS") != "1",
                                reason="~16 min on 2 cores: run with OBSERVATORY_REAL_VLLM_ROLLOUTS=1 (and make vllm)")

# CPU noise on 2 shared cores moves a tiny model's latencies by milliseconds: shifts under 20 ms or 50% of the
# baseline's median do not count here (the defaults are 5 ms and 10%).
LOOSE = {"settle_seconds": 5, "window_seconds": 30, "look_every_seconds": 3, "min_requests": 20, "mde": 1.0,
         "max_extensions": 2,
         "metrics": [{"metric": m, "tolerance": 0.5, "min_shift_ms": 20} for m in ("ttft_ms", "e2e_ms", "queue_ms")]}


def test_a_bad_config_on_real_vllm_is_rolled_back(vllm_world):
    world = vllm_world
    status, body = world.api("POST", "/api/v1/rollouts?project=default",
                             {"group": "base", "config": {"max_num_seqs": 1},
                              "plan": {"steps": [{"canary": 50, "interval": 120}], "analysis": LOOSE}})
    assert status == 201, body
    final = world.wait_state(body["id"], "rolled_back", "promoted", "paused", timeout=400)
    assert final["state"] == "rolled_back", [(t["action"], t["reason"][:300]) for t in final["transitions"]]
    rollback = final["transitions"][-1]
    assert rollback["figures"]["counts"]["canary"] >= 20
    # One sequence at a time under this load: requests queue behind each other (queue time) and some time out
    # (error rate); either names the regression with its values.
    assert ("queue time" in final["reason"] and "HL shift" in final["reason"]) or \
        ("error rate" in final["reason"] and "Fisher" in final["reason"]), final["reason"]
    world.wait_canary_gone(body["canary_group"], timeout=120)
    base = world.group("base")
    assert base["config"]["max_num_seqs"] == 8 and base["backend"] == "vllm"


def test_a_config_change_on_real_vllm_is_promoted(vllm_world):
    world = vllm_world
    status, body = world.api("POST", "/api/v1/rollouts?project=default",
                             {"group": "base", "config": {"max_num_seqs": 16},
                              "plan": {"steps": [{"canary": 50, "interval": 60}], "analysis": LOOSE}})
    assert status == 201, body
    final = world.wait_state(body["id"], "promoted", "rolled_back", "paused", timeout=1200)
    assert final["state"] == "promoted", [(t["action"], t["reason"][:300]) for t in final["transitions"]]
    base = world.group("base")
    assert base["config"]["max_num_seqs"] == 16 and base["config_version"] == final["config_version"]
    assert base["last_transition"]["phase"] == "done"
    world.wait_canary_gone(body["canary_group"], timeout=120)
