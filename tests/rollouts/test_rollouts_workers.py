"""Server mode: two real Celery worker processes on the real broker (Redis) and PostgreSQL, flooded with
rollouts.advance tasks as a doubled beat would send them, race to advance the same rollout against a real fleet
controller. Every transition happens exactly once (one audit row per action, contiguous revisions) and the fleet
sees one config replacement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from benchkit.harness import free_port, free_port_pair

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "notify"))
from test_notify_workers import start_worker, stop  # noqa: E402 - the same worker launcher

pytestmark = [pytest.mark.server_mode, pytest.mark.skipif(
    not os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://")),
    reason="server mode only: needs DATABASE_URL=postgresql://... and a real broker (CELERY_BROKER_URL)")]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def engine(fleet: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args, "--fleet", str(fleet)], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


def test_two_workers_and_a_doubled_beat_make_each_transition_once(transactional_db, tmp_path, monkeypatch):
    from django.db import connection
    from observatory.celery_app import app
    from rollouts import controls, service
    from rollouts.models import Rollout
    from tenancy.models import Project

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"""
name: workers
run_dir: {tmp_path / 'engine'}
gateway: {{bind: "127.0.0.1:{free_port()}"}}
control: {{bind: "127.0.0.1:{free_port()}"}}
replicas: {{base_port: {free_port_pair()}}}
groups:
  - {{name: base, weight: 1, replicas: 1, backend: simulator, config: {{model: {MODEL}, max_num_seqs: 64}}}}
""")
    monkeypatch.setenv("ENGINE_FLEET", str(fleet))
    up = engine(fleet, "up", "--detach")
    assert up.returncode == 0, up.stdout + up.stderr
    workers = []
    try:
        project = Project.objects.create(name="workers")
        rollout = service.create_rollout(project, group="base", config={"max_num_seqs": 96},
                                         plan={"steps": ["approval", "promote"]}, created_by="test")
        s = connection.settings_dict
        database_url = f"postgresql://{s['USER']}:{s['PASSWORD']}@{s['HOST']}:{s['PORT'] or 5432}/{s['NAME']}"
        queue = f"rollouts-test-{uuid.uuid4().hex[:8]}"
        monkeypatch.setenv("ENGINE_FLEET", str(fleet))
        os.environ["ENGINE_FLEET"] = str(fleet)  # the workers inherit it
        workers = [start_worker(f"r{i}-{queue}", queue, database_url, tmp_path, free_port()) for i in range(2)]

        def beat_until(predicate, timeout: float, what: str):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for _ in range(3):  # a doubled beat, and then some
                    app.send_task("rollouts.advance", args=[rollout.id], queue=queue, exchange=queue,
                                  routing_key=queue)
                rollout.refresh_from_db()
                if predicate(rollout):
                    return
                assert all(w.poll() is None for w in workers), [p.read_text()[-2000:]
                                                                for p in tmp_path.glob("*.log")]
                time.sleep(0.2)
            raise AssertionError(f"{what}: rollout is {rollout.state} at step {rollout.step}: "
                                 f"{[(t.action, t.reason) for t in rollout.transitions.all()]}\n"
                                 + "\n".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log")))

        beat_until(lambda r: r.state == "progressing" and r.step == 0, 60, "waiting for the approval step")
        time.sleep(2)  # more racing ticks at a step that waits
        controls.approve(rollout, "user:test")
        beat_until(lambda r: r.state == "promoted", 120, "promotion")
        time.sleep(2)  # late ticks change nothing
    finally:
        for worker in workers:
            stop(worker)
        status = json.loads(engine(fleet, "status", "--json").stdout or "{}")
        engine(fleet, "down")
    rollout = Rollout.objects.get(id=rollout.id)
    transitions = list(rollout.transitions.order_by("revision"))
    actions = [t.action for t in transitions]
    assert actions == ["created", "started", "approved", "approved-step", "promoting", "promoted"], actions
    assert [t.revision for t in transitions] == list(range(len(transitions)))
    assert Counter(t.actor for t in transitions) == {"system": 4, "test": 1, "user:test": 1}
    [group] = [g for g in status["groups"] if g["name"] == "base"]
    assert group["config_version"] == rollout.config_version and group["config"]["max_num_seqs"] == 96
    assert group["last_transition"]["phase"] == "done" and group["last_transition"]["to_version"] == \
        rollout.config_version
    # One replacement: the first replica retired, one new generation serving.
    assert len([r for r in status["retired"] if r["group"] == "base"]) == 1, status["retired"]
