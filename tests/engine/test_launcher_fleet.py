"""Fleet files (validation, environment overrides, the embedded fleet) and the controller's control API."""
from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.config import EngineConfig
from engine.launcher.cli import EMBEDDED_FLEET, main
from engine.launcher.control_api import build_control_app
from engine.launcher.fleet_controller import FleetController
from engine.launcher.fleet_spec import FleetSpec, FleetSpecError, parse_headers_text
from engine.launcher.run_dir import RunDirLock, read_or_create_token


def minimal(**overrides):
    data = {"groups": [{"name": "baseline", "weight": 1, "replicas": 1, "backend": "simulator", "config": {}}]}
    data.update(overrides)
    return data


def test_embedded_fleet_is_the_documented_default():
    spec = FleetSpec.load(EMBEDDED_FLEET, env={})
    assert spec.gateway_bind == "127.0.0.1:8100" and spec.gateway_url == "http://127.0.0.1:8100"
    assert spec.control_bind == "127.0.0.1:8190" and spec.base_port == 8101
    assert spec.run_dir == Path.cwd().resolve() / ".data" / "engine"  # relative to where `make up` runs
    baseline, canary = spec.groups
    assert (baseline.name, baseline.weight, baseline.replicas, baseline.backend) == ("baseline", 90, 1, "simulator")
    assert (canary.name, canary.weight, canary.replicas, canary.backend) == ("canary", 10, 1, "simulator")
    assert baseline.config.version == EngineConfig().version  # vLLM defaults for Llama-3.1-8B on an H100
    assert baseline.config.model == "meta-llama/Llama-3.1-8B-Instruct" and baseline.config.gpu_type == "H100"
    assert canary.config.speculative_config.method == "ngram"
    assert canary.config.speculative_config.num_speculative_tokens == 3
    assert canary.config.replace(speculative_config=None).version == baseline.config.version
    assert spec.policy_for("simulator").startup_timeout < spec.policy_for("vllm").startup_timeout


def test_environment_overrides_wire_the_fleet_to_the_platform(tmp_path):
    env = {
        "ENGINE_GATEWAY_BIND": "127.0.0.1:9100",
        "ENGINE_OTLP_ENDPOINT": "http://127.0.0.1:8000/v1/traces",
        "ENGINE_OTLP_PROTOCOL": "http/protobuf",
        "ENGINE_OTLP_HEADERS": "Authorization=Bearer%20ik_123,x-extra=1",
        "ENGINE_RUN_DIR": str(tmp_path / "run"),
        "ENGINE_CONTROL_BIND": "127.0.0.1:9190",
        "ENGINE_REPLICA_BASE_PORT": "9101",
    }
    spec = FleetSpec.load(EMBEDDED_FLEET, env=env)
    assert spec.gateway_bind == "127.0.0.1:9100" and spec.control_bind == "127.0.0.1:9190"
    assert spec.base_port == 9101 and spec.run_dir == tmp_path / "run"
    assert spec.telemetry.otlp_endpoint == "http://127.0.0.1:8000/v1/traces"
    assert spec.telemetry.otlp_protocol == "http/protobuf"
    assert spec.telemetry.otlp_headers == {"Authorization": "Bearer ik_123", "x-extra": "1"}
    environment = spec.telemetry.environment()
    assert environment["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "Authorization=Bearer%20ik_123,x-extra=1"
    assert "ik_123" not in json.dumps(spec.to_dict())  # the ingest key is never echoed
    with pytest.raises(FleetSpecError, match="ENGINE_OTLP_HEADERS"):
        FleetSpec.from_dict(minimal(), env={"ENGINE_OTLP_HEADERS": "no-equals-sign"})
    assert parse_headers_text("a=b%2Cc, d = e ") == {"a": "b,c", "d": "e"}


def test_every_problem_is_reported_with_its_place():
    data = {
        "nmae": "x",
        "gateway": {"bind": "nohost"},
        "control": {"bind": "0.0.0.0:8190"},
        "replicas": {"base_port": 80},
        "telemetry": {"otlp_protocol": "http/json", "collect_detailed_traces": "everything"},
        "supervision": {"health_interval": -1},
        "vllm": {"cpu_threads": 0},
        "groups": [
            {"name": "baseline", "weight": -1, "replicas": 0, "backend": "tgi", "config": {"max_num_seqs": 0}},
            {"name": "baseline", "weight": 0, "config": {"speculative_config": {"method": "eagle",
                                                                                "num_speculative_tokens": 2}}},
            {"name": "bad name!", "config": {"block_sise": 16}},
            "not a mapping",
        ],
    }
    with pytest.raises(FleetSpecError) as caught:
        FleetSpec.from_dict(data, env={}, source="fleet.yaml")
    problems = "\n".join(caught.value.problems)
    for needle in (
        "unknown key nmae",
        "gateway.bind: an address must be HOST:PORT",
        "control.bind must be a loopback address",
        "replicas.base_port must be an integer in 1024..65000",
        "telemetry.otlp_protocol must be one of grpc, http/protobuf",
        "telemetry.collect_detailed_traces must be one of",
        "supervision: health_interval must be a positive number",
        "vllm.cpu_threads must be an integer in 1..1024",
        "group 'baseline': weight must be a number >= 0",
        "group 'baseline': replicas must be an integer in 1..64",
        "group 'baseline': backend must be one of vllm, simulator",
        "group 'baseline'.config: max_num_seqs must be an integer >= 1, not 0",
        "needs a draft model",
        "groups[2].name must be",
        "unknown engine config key 'block_sise'",
        "groups[3] must be a mapping",
    ):
        assert needle in problems, needle
    assert str(caught.value).startswith("fleet.yaml: ")
    with pytest.raises(FleetSpecError, match="group names must be unique"):
        FleetSpec.from_dict({"groups": [{"name": "a", "config": {}}, {"name": "a", "config": {}}]}, env={})
    with pytest.raises(FleetSpecError, match="at least one group must have a weight above 0"):
        FleetSpec.from_dict({"groups": [{"name": "a", "weight": 0}]}, env={})
    with pytest.raises(FleetSpecError, match="groups must be a non-empty list"):
        FleetSpec.from_dict({}, env={})
    with pytest.raises(FleetSpecError, match="must be a mapping"):
        FleetSpec.from_dict(["groups"], env={})


def test_group_environment_reaches_each_replica_but_not_over_the_tracing_contract(tmp_path):
    data = minimal(run_dir=str(tmp_path), groups=[
        {"name": "gpu", "backend": "vllm", "env": {"CUDA_VISIBLE_DEVICES": "0,1", "OTEL_SERVICE_NAME": "x"},
         "config": {"tensor_parallel_size": 2}},
        {"name": "sim", "config": {}, "env": {"VLLM_LOGGING_LEVEL": 10}},
    ])
    spec = FleetSpec.from_dict(data, env={})
    controller = FleetController(spec, control_app=build_control_app)
    vllm = controller._replica_factory(spec.groups[0], spec.groups[0].config)(8101)
    assert Path(vllm.argv[0]).name == "vllm" and vllm.argv[1:3] == ("serve", "meta-llama/Llama-3.1-8B-Instruct")
    assert vllm.env["CUDA_VISIBLE_DEVICES"] == "0,1" and vllm.env["OTEL_SERVICE_NAME"] == "vllm"
    simulator = controller._replica_factory(spec.groups[1], spec.groups[1].config)(8102)
    assert simulator.env["VLLM_LOGGING_LEVEL"] == "10" and "--config" in simulator.argv
    config_file = simulator.argv[simulator.argv.index("--config") + 1]
    assert EngineConfig.from_dict(json.loads(Path(config_file).read_text())).version == spec.groups[1].config.version
    # A CPU group's model threads: every core but one unless the fleet sets vllm.cpu_threads.
    cpu = {"name": "cpu", "backend": "vllm", "config": {"gpu_type": "CPU", "model": "/models/tiny"}}
    spec = FleetSpec.from_dict(minimal(run_dir=str(tmp_path), groups=[cpu]), env={})
    default = FleetController(spec, control_app=build_control_app)._replica_factory(spec.groups[0],
                                                                                     spec.groups[0].config)(8103)
    assert default.env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) - 1))
    spec = FleetSpec.from_dict(minimal(run_dir=str(tmp_path), groups=[cpu], vllm={"cpu_threads": 3}), env={})
    assert FleetController(spec, control_app=build_control_app)._replica_factory(
        spec.groups[0], spec.groups[0].config)(8103).env["OMP_NUM_THREADS"] == "3"
    with pytest.raises(FleetSpecError, match="env must map variable names"):
        FleetSpec.from_dict(minimal(groups=[{"name": "a", "config": {}, "env": {"1BAD": "x"}}]), env={})


def test_bad_fleet_file_is_a_usage_error_with_every_reason(tmp_path, capsys):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("groups:\n  - name: baseline\n    config: {max_num_seqs: 0}\n")
    assert main(["status", "--fleet", str(fleet)]) == 2
    assert "max_num_seqs must be an integer >= 1" in capsys.readouterr().err
    fleet.write_text("groups: [unclosed\n")
    assert main(["up", "--fleet", str(fleet)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["up", "--fleet", str(tmp_path / "missing.yaml")]) == 2


def test_tokens_are_private_and_stable_and_the_lock_tells_if_a_controller_runs(tmp_path):
    token = read_or_create_token(tmp_path / "control.token")
    assert len(token) >= 32 and stat.S_IMODE(os.stat(tmp_path / "control.token").st_mode) == 0o600
    os.chmod(tmp_path / "control.token", 0o644)
    assert read_or_create_token(tmp_path / "control.token") == token
    assert stat.S_IMODE(os.stat(tmp_path / "control.token").st_mode) == 0o600
    lock = RunDirLock(tmp_path)
    assert not RunDirLock.held(tmp_path)
    assert lock.acquire()
    assert RunDirLock.held(tmp_path) and not RunDirLock(tmp_path).acquire()
    lock.release()
    assert not RunDirLock.held(tmp_path)


def test_status_and_down_when_nothing_runs(tmp_path, capsys):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"run_dir: {tmp_path / 'run'}\ngroups: [{{name: baseline, config: {{}}}}]\n")
    assert main(["status", "--fleet", str(fleet)]) == 3
    assert "not running" in capsys.readouterr().out
    assert main(["status", "--fleet", str(fleet), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["state"] == "not running"
    assert main(["down", "--fleet", str(fleet)]) == 0
    assert main(["down", "--fleet", str(fleet)]) == 0
    assert "not running" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- control API
def control_api(tmp_path):
    data = minimal(run_dir=str(tmp_path), groups=[
        {"name": "baseline", "weight": 90, "config": {}},
        {"name": "canary", "weight": 10, "config": {"speculative_config": {"method": "ngram",
                                                                          "num_speculative_tokens": 3}}},
    ])
    controller = FleetController(FleetSpec.from_dict(data, env={}), control_app=build_control_app)
    controller.control_token = "t" * 43
    return controller


def test_control_api_authenticates_and_validates_everything(tmp_path):
    controller = control_api(tmp_path)
    auth = {"Authorization": "Bearer " + controller.control_token}

    async def scenario():
        async with TestClient(TestServer(build_control_app(controller))) as client:
            response = await client.get("/fleet")
            assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
            assert "control.token" in (await response.json())["error"]
            assert (await client.get("/fleet", headers={"Authorization": "Bearer wrong"})).status == 401
            assert (await client.get("/fleet", headers={"Authorization": "Basic " + "t" * 43})).status == 401

            response = await client.get("/fleet", headers=auth)
            assert response.status == 200
            state = await response.json()
            assert state["fleet"] == "fleet" and state["state"] == "starting"
            assert [g["name"] for g in state["groups"]] == ["baseline", "canary"]
            assert state["groups"][1]["config"]["speculative_config"]["num_speculative_tokens"] == 3

            put = "/fleet/groups/baseline/config"
            for body, status, needle in [
                (b"{not json", 400, "not valid JSON"),
                (b"[]", 400, "body must be"),
                (json.dumps({"config": {}, "extra": 1}).encode(), 400, "body must be"),
                (json.dumps({"config": {"max_num_seqs": 0, "nope": 1}}).encode(), 400, "invalid engine config"),
                (json.dumps({"config": {}, "drain_timeout": -1}).encode(), 400, "drain_timeout"),
                (b"x" * 70_000, 413, "larger than"),
            ]:
                response = await client.put(put, data=body, headers=auth)
                assert response.status == status, (body[:40], await response.text())
                assert needle in (await response.json())["error"]
            response = await client.put(put, json={"config": {"max_num_seqs": 0, "nope": 1}}, headers=auth)
            assert "unknown engine config key 'nope'" in (await response.json())["problems"]
            response = await client.put("/fleet/groups/missing/config", json={"config": {}}, headers=auth)
            assert response.status == 404 and "baseline, canary" in (await response.json())["error"]
            response = await client.put(put, json={"config": {"max_num_seqs": 1024}}, headers=auth)
            assert response.status == 200 and (await response.json())["status"] == "unchanged"

            for body, status in [({"weights": {}}, 400), ({"weights": {"canary": -1}}, 400),
                                 ({"weights": {"canary": True}}, 400), ({"weights": {"ghost": 1}}, 404),
                                 ({"weights": {"baseline": 0, "canary": 0}}, 400), ({"w": 1}, 400)]:
                response = await client.put("/fleet/weights", json=body, headers=auth)
                assert response.status == status, body
                assert "error" in await response.json()
            response = await client.get("/nope", headers=auth)
            assert response.status == 404 and "error" in await response.json()
            response = await client.post("/fleet/stop", headers=auth)
            assert response.status == 202
            await asyncio.sleep(0.1)
            assert controller._stop.is_set()

    asyncio.run(scenario())
