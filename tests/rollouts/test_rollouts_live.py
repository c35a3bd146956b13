"""Rollouts end to end on the simulated fleet: a live platform advancing rollouts on its beat, a fleet controller
of its own with a Poisson load through its gateway, a webhook receiver. The tests run in file order and share the
fleet: the bad config is rolled back while `base` still runs its first config; the good one is promoted last."""
from __future__ import annotations

import json
import time

import pytest

# Rollouts end to end through the fleet (~7 min). Run once, in server mode, the deployment's; what is the mode's (two
# workers and a doubled beat making each transition once, on PostgreSQL and Redis) is
# tests/rollouts/test_rollouts_workers.py's, in both.
pytestmark = pytest.mark.one_suite(suite="server")

# Short steps for a test: 3 s settle, a first look after 12 s more, then every 3 s; a verdict on 20 requests a side.
FAST = {"settle_seconds": 3, "window_seconds": 12, "look_every_seconds": 3, "min_requests": 20,
        "max_extensions": 1}


@pytest.fixture(autouse=True)
def no_rollout_left_running(world):
    """A test that fails midway leaves no active rollout behind to make the next ones' start refused (busy
    group): it is aborted, and its canary and twin are waited out, after the test."""
    yield
    status, body = world.api("GET", "/api/v1/rollouts?project=default")
    for rollout in body.get("rollouts", []) if status == 200 else []:
        if rollout["state"] in ("pending", "gating", "progressing", "paused"):
            world.api("POST", f"/api/v1/rollouts/{rollout['id']}/abort")
            world.wait_canary_gone(rollout["canary_group"], timeout=120)


def start(world, config: dict, plan: dict | None = None, token: str | None = None, group: str = "base"):
    return world.api("POST", "/api/v1/rollouts?project=default",
                     {"group": group, "config": config, **({"plan": plan} if plan is not None else {})}, token=token)


def cli(world, *args: str) -> tuple[int, str, str]:
    """`manage.py ARGS`: exit status, stdout and stderr apart."""
    done = world.manage_py(*args, timeout=120)
    return done.returncode, done.stdout, done.stderr


def problems(body: dict) -> str:
    return json.dumps(body)


def test_bad_input_is_refused_with_every_problem(world):
    # An invalid config: every problem at once, in the engine's words.
    status, body = start(world, {"max_num_seqs": 0, "gpu_memory_utilization": 1.5, "bogus_knob": 1})
    assert status == 400, body
    text = problems(body)
    assert "max_num_seqs" in text and "gpu_memory_utilization" in text and "bogus_knob" in text
    # The config it runs now: nothing to roll out.
    status, body = start(world, dict(world.base_config))
    assert status == 400 and "identical" in body["error"], body
    # Weights that do not add up; a step too short for the analysis window; weights going down.
    status, body = start(world, {"max_num_seqs": 64}, {"steps": [{"canary": 10, "baseline": 80, "interval": 120}]})
    assert status == 400 and "do not add up" in problems(body), body
    status, body = start(world, {"max_num_seqs": 64}, {"steps": [{"canary": 10, "interval": 20}]})
    assert status == 400 and "too short for the analysis" in problems(body), body
    status, body = start(world, {"max_num_seqs": 64}, {"steps": [{"canary": 30, "interval": 120},
                                                               {"canary": 10, "interval": 120}]})
    assert status == 400 and "must increase" in problems(body), body
    # An unknown group; a gate on a dataset the project does not have.
    status, body = start(world, {"max_num_seqs": 64}, group="nope")
    assert status == 400 and "no replica group 'nope'" in body["error"], body
    status, body = start(world, {"max_num_seqs": 64}, {"steps": [{"gate": {"dataset": "missing"}}]})
    assert status == 400 and "missing" in body["error"], body
    # Roles: an operator may not start one; a viewer may not either.
    assert start(world, {"max_num_seqs": 64}, token=world.operator)[0] == 403
    assert start(world, {"max_num_seqs": 64}, token=world.viewer)[0] == 403
    # A second rollout on a busy group.
    status, first = start(world, {"max_num_seqs": 64}, {"steps": ["approval"], "analysis": FAST})
    assert status == 201, first
    try:
        status, body = start(world, {"max_num_seqs": 32}, {"steps": ["approval"]})
        assert status == 409 and "busy" in body["error"], body
        # Another project's token does not see it.
        assert world.api("GET", f"/api/v1/rollouts/{first['id']}", token=world.process.manage(
            "create_api_token", "--user", "stranger", "--role", "admin", "--project", "other"))[0] == 404
    finally:
        status, aborted = world.api("POST", f"/api/v1/rollouts/{first['id']}/abort", {"reason": "test over"})
        assert status == 202 and aborted["state"] == "aborted", aborted
    # Promoting an aborted rollout is refused.
    status, body = world.api("POST", f"/api/v1/rollouts/{first['id']}/promote")
    assert status == 409 and "cannot be promoted" in body["error"], body
    world.wait_canary_gone(first["canary_group"])


def test_bad_config_is_rolled_back_with_the_reason_and_a_webhook(world, webhook):
    """max_num_seqs 2 under the running load: the canary's requests queue; rolled back automatically, the reason
    names queue time with its values, and the webhook arrives."""
    # Half the group's traffic (2 req/s) on two sequences at a time: the canary's queue grows at once.
    plan = {"steps": [{"canary": 50, "interval": 90}], "analysis": {**FAST, "max_extensions": 2}}
    status, body = start(world, {"max_num_seqs": 2}, plan)
    assert status == 201, body
    rollout_id, canary = body["id"], body["canary_group"]
    final = world.wait_state(rollout_id, "rolled_back", "promoted", "paused", timeout=240)
    assert final["state"] == "rolled_back", [(t["action"], t["reason"][:300]) for t in final["transitions"]]
    assert "queue time" in final["reason"] and "HL shift" in final["reason"] and "baseline" in final["reason"], \
        final["reason"]
    actions = [t["action"] for t in final["transitions"]]
    assert actions[:3] == ["created", "started", "canary-weight"] and actions[-1] == "rolled-back", actions
    rollback = final["transitions"][-1]
    assert rollback["actor"] == "system" and rollback["figures"]["verdict"] == "fail"
    # The first look with a failing metric rolls back: TTFT or e2e latency, whichever's interval clears its
    # tolerance first (both carry the queue); either way queue time explains it.
    failing = {m["metric"]: m for m in rollback["figures"]["metrics"] if m["verdict"] == "fail"}
    latency = [failing[m] for m in ("ttft_ms", "e2e_ms") if m in failing]
    assert latency and all(m["explained_by"]["component"] == "queue_ms" for m in latency), \
        [(m["metric"], m["verdict"], m.get("ci"), m.get("tolerance_ms"), m.get("explained_by"))
         for m in rollback["figures"]["metrics"]]
    print("rollback after", rollback["at"], "reason:", final["reason"])
    print("\n".join(f"{t['at']} {t['action']} {t['reason'][:150]}" for t in final["transitions"]))
    # The canary is gone, the group untouched, its weight back.
    world.wait_canary_gone(canary)
    base = world.group("base")
    assert base["weight"] == 100 and base["config"]["max_num_batched_tokens"] == 256 \
        and base["config"].get("max_num_seqs") != 2, base
    # The webhook: the rollout event with the reason and its values.
    deadline = time.monotonic() + 60
    events = []
    while time.monotonic() < deadline and not events:
        events = [json.loads(r.body) for r in webhook.requests if b'"rollout"' in r.body]
        events = [e for e in events if e.get("kind") == "rollout" and e["rollout"]["id"] == rollout_id]
        time.sleep(0.5)
    assert events, [r.body[:300] for r in webhook.requests]
    event = events[-1]
    assert event["labels"]["state"] == "rolled_back" and event["labels"]["group"] == "base"
    assert "queue time" in event["summary"] and event["status"] == "firing"
    # The analyses behind it are readable, with both sides' quantiles for the charts.
    analysis_id = rollback["figures"]["analysis"]
    status, analysis = world.api("GET", f"/api/v1/rollouts/{rollout_id}/analyses/{analysis_id}")
    assert status == 200 and analysis["verdict"] == "fail", analysis
    ttft = next(m for m in analysis["figures"]["metrics"] if m["metric"] == "ttft_ms")
    assert len(ttft["quantiles"]["canary"]) == len(ttft["quantiles"]["baseline"]) == 8


def test_a_failing_regression_gate_stops_the_rollout_before_user_traffic(world):
    """The gate replays a golden dataset on the canary group (weight 0) and the group, paired, all at once: with
    max_num_seqs 2 the canary's queue grows; the gate fails, the rollout fails without the canary ever taking
    user traffic, and the canary is removed."""
    items = [{"id": f"g{i}", "messages": [{"role": "user", "content": "Explain latency " * (10 + 4 * i)}],
              "params": {"max_tokens": 48 + i % 16}} for i in range(24)]
    status, body = world.api("POST", "/api/v1/datasets?project=default", {"name": "golden", "items": items})
    assert status == 201, body
    status, body = start(world, {"max_num_seqs": 2}, {"steps": [{"gate": {"dataset": "golden",
                                                                          "options": {"max_concurrency": 16}}},
                                                               {"canary": 50, "interval": 60}], "analysis": FAST})
    assert status == 201, body
    final = world.wait_state(body["id"], "failed", "paused", "promoted", "rolled_back", timeout=300)
    assert final["state"] == "failed", [(t["action"], t["reason"][:300]) for t in final["transitions"]]
    actions = [t["action"] for t in final["transitions"]]
    assert actions == ["created", "started", "gate-started", "gate-failed"], actions
    assert "regression gate failed" in final["reason"] and f"run {final['gate_run']}" in final["reason"]
    assert "queue" in final["reason"], final["reason"]
    assert final["canary_weight"] == 0
    world.wait_canary_gone(body["canary_group"])
    status, run = world.api("GET", f"/api/v1/regression-runs/{final['gate_run']}")
    assert status == 200 and run["verdict"] == "fail"
    assert run["target"] == {"kind": "group", "group": body["canary_group"]}, run["target"]
    # Paired with the baseline twin (the group's config on as many replicas, also at weight 0), not the loaded group.
    assert body["baseline_group"] == body["twin_group"] == body["canary_group"].replace("-canary-", "-baseline-")
    assert run["baseline_target"] == {"kind": "group", "group": body["baseline_group"]}, run["baseline_target"]


def test_no_traffic_pauses_as_inconclusive(world):
    """No requests at all: never a pass, never a rollback; the step is extended once, then the rollout pauses."""
    world.stop_load()
    try:
        time.sleep(3)
        plan = {"steps": [{"canary": 20, "interval": 15}], "analysis": {**FAST, "max_extensions": 1}}
        status, body = start(world, {"max_num_seqs": 96}, plan)
        assert status == 201, body
        paused = world.wait_state(body["id"], "paused", "rolled_back", "promoted", timeout=200)
        assert paused["state"] == "paused", [(t["action"], t["reason"][:300]) for t in paused["transitions"]]
        assert "inconclusive" in paused["reason"] and "not enough data" in paused["reason"], paused["reason"]
        actions = [t["action"] for t in paused["transitions"]]
        assert "step-extended" in actions and "rolled-back" not in actions and "step-passed" not in actions
        # Pausing keeps the canary where it was; an abort rolls it back.
        status, aborted = world.api("POST", f"/api/v1/rollouts/{body['id']}/abort")
        assert status == 202 and aborted["state"] == "aborted"
        world.wait_canary_gone(body["canary_group"])
    finally:
        world.start_load()


def test_platform_killed_mid_step_resumes_the_same_step(world):
    plan = {"steps": [{"canary": 20, "interval": 600}], "analysis": FAST}
    status, body = start(world, {"max_num_seqs": 128}, plan)
    assert status == 201, body
    rollout_id = body["id"]
    before = world.wait_for(rollout_id, lambda b: len(b.get("analyses", [])) >= 1, timeout=180,
                            what="a first analysis of the canary step")
    world.process.kill()
    world.process.start(timeout=180)
    after = world.wait_for(rollout_id, lambda b: len(b["analyses"]) > len(before["analyses"]) + 1, timeout=120,
                           what="analyses after the restart")
    assert after["state"] == "progressing" and after["step"] == before["step"] == 0
    assert after["step_started_at"] == before["step_started_at"]
    actions = [t["action"] for t in after["transitions"]]
    assert actions.count("canary-weight") == 1 and actions.count("started") == 1, actions
    # The fleet controller restarted: it comes back with the fleet file's groups only; the rollout starts its
    # canary again and gives it its weight back, in the same step.
    assert world.engine("down").returncode == 0
    up = world.engine("up", "--detach")
    assert up.returncode == 0, up.stdout + up.stderr
    deadline = time.monotonic() + 120
    canary = None
    while time.monotonic() < deadline:
        canary = world.group(body["canary_group"])
        if canary is not None and canary["weight"] > 0 and canary["upstreams"]:
            break
        time.sleep(0.5)
    assert canary is not None and canary["weight"] == pytest.approx(20.0), canary  # 20% of base's 100
    again = world.rollout(rollout_id)
    assert again["state"] == "progressing" and again["step"] == 0 and again["step_started_at"] == \
        before["step_started_at"]
    status, aborted = world.api("POST", f"/api/v1/rollouts/{rollout_id}/abort", {"reason": "restart test over"})
    assert status == 202, aborted
    world.wait_canary_gone(body["canary_group"])


def test_the_command_line_and_the_metrics(world):
    config = world.root / "new.yaml"
    config.write_text("max_num_seqs: 40\n")
    plan = world.root / "plan.yaml"
    plan.write_text("steps:\n  - canary: 10\n    interval: 5m\n  - approval\n")
    code, out, err = cli(world, "rollout", "start", "--project", "default", "--group", "base", "--config",
                         str(config), "--plan", str(plan))
    assert code == 0 and out.strip().isdigit(), (out, err)
    rollout_id = int(out.strip())
    world.wait_for(rollout_id, lambda b: b["canary_weight"] == 10, timeout=120, what="the canary at 10%")
    code, out, err = cli(world, "rollout", "show", str(rollout_id))
    assert code == 0 and "max_num_seqs 48 → 40" in out and "canary 10% for 300 s" in out, out
    # /metrics with a token: the rollout's state, step and weight.
    status, _ = world.api("GET", "/api/v1/rollouts")
    import urllib.request
    request = urllib.request.Request(world.process.url + "/metrics", headers={"Authorization": f"Bearer {world.viewer}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    assert f'observatory_rollout_state{{group="base",project="default",rollout="{rollout_id}",state="progressing"}} 1.0' \
        in text, [line for line in text.splitlines() if "rollout" in line]
    assert f'observatory_rollout_canary_weight_percent{{group="base",project="default",rollout="{rollout_id}"}} 10.0' \
        in text
    assert "observatory_rollout_transitions_total" in text
    # Errors are exit 3 with the reason; controls are audited with the command's actor.
    code, out, err = cli(world, "rollout", "start", "--project", "default", "--group", "base", "--config", str(config))
    assert code == 3 and "busy" in err, (out, err)
    code, out, err = cli(world, "rollout", "pause", str(rollout_id), "--reason", "checking something")
    assert code == 0 and "paused" in out, (out, err)
    code, out, err = cli(world, "rollout", "show", str(rollout_id))
    assert code == 2 and "checking something" in out
    code, out, err = cli(world, "rollout", "abort", str(rollout_id))
    assert code == 0 and "aborted" in out
    actors = [t["actor"] for t in world.rollout(rollout_id)["transitions"]]
    assert actors[0].startswith("cli:") and actors[-1].startswith("cli:")
    world.wait_canary_gone(f"base-canary-{rollout_id}")


def test_good_config_is_promoted_and_the_group_runs_it(world, webhook):
    """A bigger token budget per step prefills long prompts at once: TTFT improves; promoted, the group runs it."""
    plan = {"steps": [{"canary": 50, "interval": 60}], "analysis": FAST}
    status, body = start(world, {"max_num_batched_tokens": 8192}, plan)
    assert status == 201, body
    final = world.wait_state(body["id"], "promoted", "rolled_back", "paused", timeout=300)
    assert final["state"] == "promoted", [(t["action"], t["reason"][:300]) for t in final["transitions"]]
    passed = next(t for t in final["transitions"] if t["action"] == "step-passed")
    ttft = next(m for m in passed["figures"]["metrics"] if m["metric"] == "ttft_ms")
    assert ttft["verdict"] == "pass" and ttft["hl_shift"] < 0, ttft
    base = world.group("base")
    assert base["config"]["max_num_batched_tokens"] == 8192 and base["config_version"] == final["config_version"]
    assert base["weight"] == 100
    world.wait_canary_gone(body["canary_group"])
