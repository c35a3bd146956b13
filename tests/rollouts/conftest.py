"""The rollout tests' live world, as in production: a fleet controller of its own (`python -m engine up --detach`,
not a child of the platform, so the platform can be killed and restarted under a running rollout), a Poisson load
through its gateway, and the platform (`runplatform`, its in-process worker and beat advancing rollouts) reading
the fleet's spans. Group `base` runs Llama-3.1-8B on a simulated H100 with a small token budget per step
(max_num_batched_tokens 256: long prompts take several steps to prefill), which a better config can beat on TTFT.
In server mode the platform gets a PostgreSQL database of its own."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from observatory.bench.harness import PlatformProcess, free_port, free_port_pair
from otlp_live_helpers import _drop_database, _server_mode_database

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "notify"))

BASE_CONFIG = {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "H100", "tensor_parallel_size": 1,
               "max_num_seqs": 48, "max_num_batched_tokens": 256}
FLEET = """\
name: rollout-test
run_dir: {run_dir}
gateway:
  bind: 127.0.0.1:{gateway}
control:
  bind: 127.0.0.1:{control}
replicas:
  host: 127.0.0.1
  base_port: {replicas}
{vllm}telemetry:
  otlp_endpoint: {otlp_endpoint}
  otlp_protocol: {otlp_protocol}
  otlp_headers:
    authorization: "Bearer {key}"
groups:
{groups}
"""
SIMULATED_GROUP = """\
  - name: base
    weight: 100
    replicas: 1
    backend: simulator
    seed: 7
    config: {config}
"""
VLLM_GROUP = """\
  - name: base
    weight: 100
    replicas: 1
    backend: vllm
    served_model_name: tiny-llama
    config: {config}
"""
# Poisson arrivals through the gateway: long-ish prompts for the simulated H100 (a small token budget hurts them),
# short ones for the tiny model on CPU.
SIMULATED_LOAD = {"rate": 4.0, "input_len": "300:1500", "output_len": "50:150"}
VLLM_LOAD = {"rate": 6.0, "input_len": "20:80", "output_len": "16:48", "model": "tiny-llama"}


class World:
    def __init__(self, root: Path, process: PlatformProcess, fleet_file: Path, gateway: int, admin: str,
                 operator: str, viewer: str, base_config: dict, load: dict):
        self.root = root
        self.process = process
        self.fleet_file = fleet_file
        self.gateway = gateway
        self.admin = admin
        self.operator = operator
        self.viewer = viewer
        self.base_config = dict(base_config)
        self.load_spec = dict(load)
        self.load: subprocess.Popen | None = None
        self._load_seed = 0

    # -- the API and the CLI
    def api(self, method: str, path: str, body=None, token: str | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.process.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.admin}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def cli(self, *args: str, timeout: float = 120) -> tuple[int, str, str]:
        out = subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=self.process.env,
                             capture_output=True, text=True, timeout=timeout)
        return out.returncode, out.stdout, out.stderr

    def engine(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine", *args, "--fleet", str(self.fleet_file)],
                              env=self.process.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)

    def fleet(self) -> dict:
        result = self.engine("status", "--json", timeout=30)
        return json.loads(result.stdout)

    def group(self, name: str) -> dict | None:
        fleet = self.fleet()
        snapshot = fleet if "groups" in fleet else (fleet.get("fleet") or {})
        return next((g for g in snapshot.get("groups") or [] if g["name"] == name), None)

    # -- the load
    def start_load(self) -> None:
        self.stop_load()
        self._load_seed += 1
        spec = self.load_spec
        log = open(self.root / f"load-{self._load_seed}.log", "wb")
        self.load = subprocess.Popen(
            [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://127.0.0.1:{self.gateway}/v1",
             "--arrival", "poisson", "--rate", str(spec["rate"]), "--duration", "3600", "--quiet", "--timeout",
             "120", "--input-len", spec["input_len"], "--output-len", spec["output_len"],
             *(["--model", spec["model"]] if spec.get("model") else []), "--seed", str(self._load_seed)],
            env=self.process.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()

    def stop_load(self) -> None:
        if self.load is not None and self.load.poll() is None:
            self.load.terminate()
            try:
                self.load.wait(20)
            except subprocess.TimeoutExpired:
                self.load.kill()
        self.load = None

    # -- rollouts
    def rollout(self, rollout_id: int) -> dict:
        status, body = self.api("GET", f"/api/v1/rollouts/{rollout_id}")
        assert status == 200, body
        return body

    def wait_for(self, rollout_id: int, predicate, timeout: float = 300, what: str = "") -> dict:
        deadline = time.monotonic() + timeout
        body = {}
        while time.monotonic() < deadline:
            body = self.rollout(rollout_id)
            if predicate(body):
                return body
            time.sleep(0.5)
        raise AssertionError(f"rollout {rollout_id}: {what or 'condition'} not reached in {timeout:g} s: "
                             f"{json.dumps({k: body.get(k) for k in ('state', 'step', 'reason')})}\n"
                             f"{json.dumps(body.get('transitions', [])[-6:], indent=1)[:3000]}\n"
                             f"{self.process.log_tail(3000)}")

    def wait_state(self, rollout_id: int, *states: str, timeout: float = 300) -> dict:
        return self.wait_for(rollout_id, lambda b: b["state"] in states, timeout, what=f"state in {states}")

    def wait_canary_gone(self, name: str, timeout: float = 60) -> None:
        """The canary group and its baseline twin (``G-canary-N`` and ``G-baseline-N``) both out of the fleet."""
        names = (name, name.replace("-canary-", "-baseline-"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.group(n) is None for n in names):
                return
            time.sleep(0.5)
        raise AssertionError(f"canary group {name} or its twin still in the fleet: "
                             f"{[n for n in names if self.group(n) is not None]}")


@contextlib.contextmanager
def open_world(root: Path, groups: str, base_config: dict, load: dict, vllm_executable: str | None = None):
    """A platform, a fleet controller of its own with ``groups`` (YAML), and a load through its gateway."""
    database = _server_mode_database()
    process = PlatformProcess(
        data_dir=str(root / "data"), grpc=vllm_executable is not None,  # vLLM exports its spans over gRPC only
        extra_env={**({"DATABASE_URL": database[1]} if database else {}),
                   "ROLLOUTS_SWEEP_INTERVAL_SECONDS": "1", "ROLLOUTS_FLEET_GRACE_SECONDS": "20",
                   "ROLLOUTS_TICK_LEASE_SECONDS": "20",
                   "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2", "REGRESSIONS_QUEUED_GRACE_SECONDS": "3",
                   "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": "127.0.0.1:1024-65535",
                   "NOTIFY_DELIVER_INTERVAL_SECONDS": "1"})
    gateway, control, replicas = free_port(), free_port(), free_port_pair()
    fleet_file = root / "fleet.yaml"
    process.env["ENGINE_FLEET"] = str(fleet_file)
    world = None
    try:
        _, key, _, admin, operator, viewer = process.manage_many(
            ("migrate", "-v0"), ("create_ingest_key", "--project", "default"),
            ("create_ingest_key", "--project", "other"),
            ("create_api_token", "--user", "root", "--role", "admin", "--project", "default"),
            ("create_api_token", "--user", "ops", "--role", "operator", "--project", "default"),
            ("create_api_token", "--user", "eve", "--role", "viewer", "--project", "default"))
        fleet_file.write_text(FLEET.format(run_dir=root / "engine", gateway=gateway, control=control,
                                           replicas=replicas, key=key, groups=groups,
                                           otlp_endpoint=f"127.0.0.1:{process.grpc_port}" if process.grpc_port
                                           else f"{process.url}/v1/traces",
                                           otlp_protocol="grpc" if process.grpc_port else "http/protobuf",
                                           vllm=f"vllm: {{executable: {vllm_executable}}}\n" if vllm_executable
                                           else ""))
        process.start(timeout=180)
        world = World(root, process, fleet_file, gateway, admin, operator, viewer, base_config, load)
        up = world.engine("up", "--detach", timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        world.start_load()
        yield world
    finally:
        if world is not None:
            world.stop_load()
            world.engine("down")
        process.stop()
        if database:
            _drop_database(*database)


@pytest.fixture(scope="package")
def world(tmp_path_factory):
    groups = SIMULATED_GROUP.format(config=json.dumps(BASE_CONFIG))
    with open_world(tmp_path_factory.mktemp("rollouts"), groups, BASE_CONFIG, SIMULATED_LOAD) as opened:
        yield opened


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory, real_vllm_executable, tiny_model_dir):
    """The same with a real vLLM group (its CPU build serving the test-size tiny Llama)."""
    config = {"model": tiny_model_dir, "gpu_type": "CPU", "max_num_seqs": 8,
              "kv_cache_memory_bytes": 32 * 1024 * 1024}
    groups = VLLM_GROUP.format(config=json.dumps(config))
    with open_world(tmp_path_factory.mktemp("rollouts-vllm"), groups, config, VLLM_LOAD,
                    vllm_executable=real_vllm_executable) as opened:
        yield opened


@pytest.fixture(scope="package")
def webhook(world):
    """A webhook receiver registered as the project's channel (rollout events arrive here)."""
    from notify_receivers import Receiver

    with Receiver() as receiver:
        status, body = world.api("POST", "/api/v1/channels?project=default",
                                 {"name": "ops-hook", "kind": "webhook", "url": receiver.url})
        assert status == 201, body
        yield receiver


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
