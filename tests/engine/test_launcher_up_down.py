"""The whole fleet with real processes: ``up --detach``, traffic through the gateway, a config change under load,
kill -9 of a replica, ``down``; and the clean-up after a controller that died."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from fleet_support import fleet_control

from engine.launcher.cli import main
from engine.launcher.process_groups import process_alive
from engine.launcher.run_dir import RunDirLock

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine.replica.cli") is None or importlib.util.find_spec("engine.gateway.server") is None,
    reason="engine.replica and engine.gateway are needed for the fleet integration tests",
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            sockets.append(probe)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for probe in sockets:
            probe.close()


def write_fleet(tmp_path: Path) -> tuple[Path, dict]:
    gateway, control, base = free_ports(3)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"""
name: itest
run_dir: {tmp_path / 'run'}
gateway: {{bind: "127.0.0.1:{gateway}"}}
control: {{bind: "127.0.0.1:{control}"}}
replicas: {{base_port: {base}}}
supervision: {{health_interval: 0.5, backoff_initial: 0.2, backoff_max: 1.0, terminate_grace: 5}}
groups:
  - name: baseline
    weight: 90
    replicas: 1
    backend: simulator
    seed: 1
    config: {{model: {MODEL}}}
  - name: canary
    weight: 10
    replicas: 1
    backend: simulator
    seed: 2
    config:
      model: {MODEL}
      speculative_config: {{method: ngram, num_speculative_tokens: 3}}
""")
    return fleet, {"gateway": f"http://127.0.0.1:{gateway}", "control": f"http://127.0.0.1:{control}",
                   "run_dir": tmp_path / "run"}


def control(urls: dict, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    return fleet_control(urls["control"], urls["run_dir"], method, path, body)


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def status_json(fleet: Path, capsys) -> dict:
    capsys.readouterr()
    main(["status", "--fleet", str(fleet), "--json"])
    return json.loads(capsys.readouterr().out)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def load_of(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


def test_fleet_up_traffic_config_change_crash_and_down(tmp_path, capsys):
    fleet, urls = write_fleet(tmp_path)
    recorded_pids: set[int] = set()
    try:
        assert main(["up", "--fleet", str(fleet), "--detach", "--timeout", "60"]) == 0
        assert "is running" in capsys.readouterr().out

        # A completion through the gateway.
        request = post(urls["gateway"] + "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 8})
        with urllib.request.urlopen(request, timeout=30) as response:
            completion = json.loads(response.read())
        assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] >= 1

        # status: everything healthy, in the table and in JSON.
        assert main(["status", "--fleet", str(fleet)]) == 0
        table = capsys.readouterr().out
        assert "gateway" in table and "baseline-g1-r1" in table and "canary-g1-r1" in table
        state = status_json(fleet, capsys)
        assert state["state"] == "running" and state["gateway"]["state"] == "healthy"
        assert {r["group"]: r["state"] for r in state["replicas"]} == {"baseline": "healthy", "canary": "healthy"}
        recorded_pids |= {p["pid"] for p in state["processes"]} | {state["pid"]}

        # Send all traffic to baseline, then replace baseline's config while a stream runs on it.
        assert control(urls, "PUT", "/fleet/weights", {"weights": {"canary": 0}}) == \
            (200, {"weights": {"baseline": 90, "canary": 0}})
        [old] = [r for r in state["replicas"] if r["group"] == "baseline"]
        stream_result: dict = {}

        def stream() -> None:
            body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 450, "stream": True,
                    "ignore_eos": True}
            try:
                with urllib.request.urlopen(post(urls["gateway"] + "/v1/completions", body), timeout=60) as resp:
                    lines = [line.decode().strip() for line in resp if line.strip()]
                stream_result["status"] = resp.status
                stream_result["lines"] = lines
            except Exception as exc:  # reported by the assertions below
                stream_result["error"] = repr(exc)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: load_of(old["url"]) > 0, 10, "the stream to reach the baseline replica")
        status, answer = control(urls, "PUT", "/fleet/groups/baseline/config", {"config": {"max_num_seqs": 256}})
        assert status == 202 and answer["changes"] == {"max_num_seqs": [1024, 256]}
        assert control(urls, "PUT", "/fleet/groups/baseline/config", {"config": {"max_num_seqs": 128}})[0] == 409
        wait_for(lambda: control(urls, "GET", "/fleet")[1]["groups"][0]["transition"] is not None
                 and control(urls, "GET", "/fleet")[1]["groups"][0]["transition"]["phase"] == "draining",
                 20, "the old replica to drain")
        assert reader.is_alive()  # the old replica is draining while our stream still runs on it
        reader.join(30)
        assert "error" not in stream_result, stream_result
        assert stream_result["status"] == 200 and stream_result["lines"][-1] == "data: [DONE]"
        assert not any('"error"' in line for line in stream_result["lines"])
        fleet_state = wait_for(lambda: (lambda s: s if s["groups"][0]["last_transition"] else None)(
            control(urls, "GET", "/fleet")[1]), 20, "the replacement to finish")
        last = fleet_state["groups"][0]["last_transition"]
        assert last["phase"] == "done" and last["result"]["stopped"] == {old["name"]: "idle"}
        assert fleet_state["groups"][0]["config_version"] == last["to_version"]
        [new] = [r for r in fleet_state["replicas"] if r["group"] == "baseline"]
        assert new["config_version"] == last["to_version"] and new["port"] != old["port"]
        assert not process_alive(old["pid"], old["start_ticks"])
        assert fleet_state["groups"][0]["upstreams"] == [new["url"]]
        recorded_pids.add(new["pid"])

        # kill -9 a replica: it is restarted on its port and the fleet is running again.
        os.kill(new["pid"], signal.SIGKILL)
        restarted = wait_for(lambda: next((r for r in status_json(fleet, capsys)["replicas"]
                                           if r["name"] == new["name"] and r["restarts"] == 1
                                           and r["state"] == "healthy"), None), 20, "the restart")
        assert restarted["last_exit_code"] == -signal.SIGKILL and restarted["pid"] != new["pid"]
        recorded_pids.add(restarted["pid"])
        wait_for(lambda: status_json(fleet, capsys)["state"] == "running", 10, "the fleet to be running again")
        with urllib.request.urlopen(post(urls["gateway"] + "/v1/completions",
                                         {"model": MODEL, "prompt": "Hi", "max_tokens": 4}), timeout=30) as response:
            assert response.status == 200
    finally:
        assert main(["down", "--fleet", str(fleet)]) == 0
    assert "stopped" in capsys.readouterr().out
    assert not [pid for pid in recorded_pids if process_alive(pid)]
    assert main(["status", "--fleet", str(fleet)]) == 3
    assert main(["down", "--fleet", str(fleet)]) == 0  # idempotent


def test_groups_added_at_run_time_serve_pinned_traffic_then_are_drained_away(tmp_path, capsys):
    """A rollout's canary: PUT /fleet/groups/{name} starts a group from another's backend and model with its own
    config, at weight 0 (reached through X-Engine-Group only), then with a weight; DELETE drains and stops it."""
    fleet, urls = write_fleet(tmp_path)
    try:
        assert main(["up", "--fleet", str(fleet), "--detach", "--timeout", "60"]) == 0
        body = {"base": "baseline", "config": {"model": MODEL, "max_num_seqs": 64}, "weight": 0}
        for bad, status, needle in [({**body, "base": "ghost"}, 404, "no group 'ghost'"),
                                    ({"config": {}}, 400, "body must be"),
                                    ({**body, "replicas": 0}, 400, "replicas"),
                                    ({**body, "config": {"max_num_seqs": -1}}, 400, "invalid engine config")]:
            answer = control(urls, "PUT", "/fleet/groups/baseline-canary-1", bad)
            assert answer[0] == status and needle in answer[1]["error"], (bad, answer)
        assert control(urls, "PUT", "/fleet/groups/baseline", body)[0] == 409  # a group of the fleet file
        status, answer = control(urls, "PUT", "/fleet/groups/baseline-canary-1", body)
        assert status == 201 and answer["group"]["dynamic"] and answer["group"]["base"] == "baseline"
        assert control(urls, "PUT", "/fleet/groups/baseline-canary-1", body)[0] == 200  # idempotent
        assert control(urls, "PUT", "/fleet/groups/baseline-canary-1",
                       {**body, "config": {"model": MODEL, "max_num_seqs": 32}})[0] == 409
        new = wait_for(lambda: next((r for r in status_json(fleet, capsys)["replicas"]
                                     if r["group"] == "baseline-canary-1" and r["state"] == "healthy"), None),
                       30, "the run-time group's replica")
        # Pinned to it by header although its weight is 0.
        pinned = urllib.request.Request(urls["gateway"] + "/v1/completions", method="POST",
                                        data=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4}).encode(),
                                        headers={"Content-Type": "application/json",
                                                 "X-Engine-Group": "baseline-canary-1"})
        wait_for(lambda: _answers(pinned), 20, "the gateway to route to the new group")
        assert control(urls, "PUT", "/fleet/weights", {"weights": {"baseline-canary-1": 10}})[0] == 200
        groups = {g["name"]: g for g in control(urls, "GET", "/fleet")[1]["groups"]}
        assert groups["baseline-canary-1"]["weight"] == 10 and groups["baseline-canary-1"]["config_version"] == \
            new["config_version"]
        assert control(urls, "DELETE", "/fleet/groups/baseline")[0] == 409
        status, answer = control(urls, "DELETE", "/fleet/groups/baseline-canary-1")
        assert status == 202 and answer["replicas"] == [new["name"]]
        assert control(urls, "DELETE", "/fleet/groups/baseline-canary-1") == \
            (200, {"status": "absent", "group": "baseline-canary-1"})
        wait_for(lambda: not process_alive(new["pid"], new["start_ticks"]), 30, "the replica to stop")
        state = status_json(fleet, capsys)
        assert [g["name"] for g in state["groups"]] == ["baseline", "canary"]
        assert wait_for(lambda: status_json(fleet, capsys)["state"] == "running", 20, "the fleet to be running")
    finally:
        assert main(["down", "--fleet", str(fleet)]) == 0


def _answers(request: urllib.request.Request) -> bool:
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False


def test_down_cleans_up_after_a_controller_that_died(tmp_path, capsys):
    fleet, urls = write_fleet(tmp_path)
    try:
        assert main(["up", "--fleet", str(fleet), "--detach", "--timeout", "60"]) == 0
        state = status_json(fleet, capsys)
        children = [p["pid"] for p in state["processes"]]
        assert len(children) == 3
        os.kill(state["pid"], signal.SIGKILL)
        # The leader shows "Z" while the controller's other threads still exit (and still hold the run
        # directory's flock): dead means the lock is free too.
        wait_for(lambda: not process_alive(state["pid"], state["start_ticks"])
                 and not RunDirLock.held(urls["run_dir"]), 10, "the controller to die")
        assert all(process_alive(pid) for pid in children)  # orphans, still holding their ports
        capsys.readouterr()
        assert main(["status", "--fleet", str(fleet)]) == 3
        assert "down` cleans up" in capsys.readouterr().out
    finally:
        assert main(["down", "--fleet", str(fleet)]) == 0
    assert "stopped 3 leftover" in capsys.readouterr().out
    assert not [pid for pid in children if process_alive(pid)]
    assert not (urls["run_dir"] / "controller.pid").exists()


def test_up_detach_fails_with_the_reason_and_the_log(tmp_path, capsys):
    fleet, urls = write_fleet(tmp_path)
    port = int(urls["control"].rsplit(":", 1)[1])
    with socket.socket() as squatter:  # the control API's port is taken
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        assert main(["up", "--fleet", str(fleet), "--detach", "--timeout", "30"]) == 1
    err = capsys.readouterr().err
    assert "exited with status 1" in err and "controller.log" in err and "cannot serve the control API" in err
    assert main(["status", "--fleet", str(fleet)]) == 3
