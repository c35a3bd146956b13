"""The rollout tests' live world, as in production: a fleet controller of its own (`python -m engine up --detach`,
not a child of the platform, so the platform can be killed and restarted under a running rollout), a Poisson load
through its gateway, and the platform (`runplatform`, its in-process worker and beat advancing rollouts) reading
the fleet's spans. Group `base` runs Llama-3.1-8B on a simulated H100 with a small token budget per step
(max_num_batched_tokens 256: long prompts take several steps to prefill), which a better config can beat on TTFT.
In server mode the platform gets a PostgreSQL database of its own."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleet_support import FleetPlatform, closed_with_directory, group, open_fleet_platform, run_engine

HERE = Path(__file__).resolve().parent

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "notify"))

BASE_CONFIG = {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "H100", "tensor_parallel_size": 1,
               "max_num_seqs": 48, "max_num_batched_tokens": 256}
# Poisson arrivals through the gateway: long-ish prompts for the simulated H100 (a small token budget hurts them),
# short ones for the tiny model on CPU.
SIMULATED_LOAD = {"rate": 4.0, "input_len": "300:1500", "output_len": "50:150"}
VLLM_LOAD = {"rate": 6.0, "input_len": "20:80", "output_len": "16:48", "model": "tiny-llama"}


@dataclasses.dataclass(eq=False)
class World(FleetPlatform):
    base_config: dict = dataclasses.field(default_factory=dict)
    load_spec: dict = dataclasses.field(default_factory=dict)
    load: subprocess.Popen | None = None
    load_seed: int = 0

    # -- the API tokens (project default), the CLI and the fleet
    @property
    def admin(self) -> str:
        return self.tokens["root"]

    @property
    def operator(self) -> str:
        return self.tokens["ops"]

    @property
    def viewer(self) -> str:
        return self.tokens["eve"]

    def engine(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return run_engine(self.fleet_file, *args, timeout=timeout, env=self.process.env)

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
        self.load_seed += 1
        spec = self.load_spec
        log = open(self.root / f"load-{self.load_seed}.log", "wb")
        self.load = subprocess.Popen(
            [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://127.0.0.1:{self.gateway}/v1",
             "--arrival", "poisson", "--rate", str(spec["rate"]), "--duration", "3600", "--quiet", "--timeout",
             "120", "--input-len", spec["input_len"], "--output-len", spec["output_len"],
             *(["--model", spec["model"]] if spec.get("model") else []), "--seed", str(self.load_seed)],
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
def open_world(root: Path, groups: list[dict], base_config: dict, load: dict, vllm_executable: str | None = None):
    """A platform, a fleet controller of its own with ``groups``, and a load through its gateway."""
    with open_fleet_platform(
            root, name="rollout-test", groups=groups, with_engine=False, cls=World, base_config=dict(base_config),
            load_spec=dict(load), vllm_executable=vllm_executable,
            grpc=vllm_executable is not None,  # vLLM exports its spans over gRPC only
            tokens=(("root", "admin"), ("ops", "operator"), ("eve", "viewer")),
            env={"ROLLOUTS_SWEEP_INTERVAL_SECONDS": "1", "ROLLOUTS_FLEET_GRACE_SECONDS": "20",
                 "ROLLOUTS_TICK_LEASE_SECONDS": "20",
                 "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2", "REGRESSIONS_QUEUED_GRACE_SECONDS": "3",
                 "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": "127.0.0.1:1024-65535",
                 "NOTIFY_DELIVER_INTERVAL_SECONDS": "1"}) as world:
        try:
            up = world.engine("up", "--detach", timeout=600)
            assert up.returncode == 0, up.stdout + up.stderr
            world.start_load()
            yield world
        finally:
            world.stop_load()
            world.engine("down")


@pytest.fixture(scope="package")
def world(tmp_path_factory):
    groups = [group("base", BASE_CONFIG, seed=7)]
    with closed_with_directory(HERE, open_world(tmp_path_factory.mktemp("rollouts"), groups, BASE_CONFIG,
                                                SIMULATED_LOAD)) as opened:
        yield opened


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory, real_vllm_executable, tiny_model_dir):
    """The same with a real vLLM group (its CPU build serving the test-size tiny Llama)."""
    config = {"model": tiny_model_dir, "gpu_type": "CPU", "max_num_seqs": 8,
              "kv_cache_memory_bytes": 32 * 1024 * 1024}
    groups = [group("base", config, backend="vllm", served_model_name="tiny-llama")]
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

