"""The tuning tests' live platform: a simulated fleet whose group `base` runs Llama-3.1-8B on one (simulated)
H100 with max_num_seqs 8, a poor config for chat traffic at tens of requests/s, which a study must beat and its
confirmation must show. In server mode the platform gets a PostgreSQL database of its own."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from observatory.bench.harness import PlatformProcess, free_port, free_port_pair
from otlp_live_helpers import _drop_database, _server_mode_database

# The scratch ClickHouse store and request rows of the alerts tests (tests/alerts/alerts_support.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "alerts"))

ROOT = Path(__file__).resolve().parents[2]
FLEET = """\
name: tuning-test
run_dir: {run_dir}
gateway:
  bind: 127.0.0.1:{gateway}
control:
  bind: 127.0.0.1:{control}
replicas:
  host: 127.0.0.1
  base_port: {replicas}
telemetry:
  otlp_protocol: http/protobuf
groups:
  - name: base
    weight: 100
    replicas: 1
    backend: simulator
    config: {{model: meta-llama/Llama-3.1-8B-Instruct, gpu_type: H100, tensor_parallel_size: 1, max_num_seqs: 8}}
"""


class Live:
    def __init__(self, process: PlatformProcess, token: str):
        self.process = process
        self.token = token

    def api(self, method: str, path: str, body=None, token: str | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.process.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def cli(self, *args: str, timeout: float = 600) -> tuple[int, str]:
        out = subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=self.process.env,
                             capture_output=True, text=True, timeout=timeout)
        return out.returncode, out.stdout + out.stderr

    def wait(self, study_id: int, timeout: float = 400) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, study = self.api("GET", f"/api/v1/tuning-studies/{study_id}")
            assert status == 200, study
            if study["state"] not in ("queued", "searching", "rescoring", "confirming"):
                return study
            time.sleep(0.5)
        raise AssertionError(f"study {study_id} did not end: {study}\n{self.process.log_tail()}")


@pytest.fixture(scope="package")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("tuning")
    gateway, control, replicas = free_port(), free_port(), free_port_pair()
    fleet = root / "fleet.yaml"
    fleet.write_text(FLEET.format(run_dir=root / "engine", gateway=gateway, control=control, replicas=replicas))
    database = _server_mode_database()
    process = PlatformProcess(
        data_dir=str(root / "data"), args=("--with-engine",),
        extra_env={**({"DATABASE_URL": database[1]} if database else {}), "ENGINE_FLEET": str(fleet),
                   "TUNING_STALE_SECONDS": "6", "TUNING_SWEEP_INTERVAL_SECONDS": "2",
                   "TUNING_QUEUED_GRACE_SECONDS": "3", "TUNING_CONFIRM_MAX_RATE": "16", "TUNING_CONFIRM_ITEMS": "80",
                   # A first replay at 3x the predicted goodput, which a winner under the cap misses: the steps down
                   # are tested (test_tuning_live.py). Winners above the cap are replayed at the cap only.
                   "TUNING_CONFIRM_RATE_STEPS": "3,1,0.7,0.5",
                   # Two workers share each study's trials (ask-and-tell on the shared Optuna storage).
                   "TUNING_PARALLEL_TRIALS": "2",
                   # Smaller studies than the defaults (the winner still clearly beats max_num_seqs 8): 200
                   # simulated requests per rate, the best 3 re-scored over 3 seeds.
                   "TUNING_SIM_REQUESTS": "200", "TUNING_RESCORE_CANDIDATES": "3", "TUNING_RESCORE_SEEDS": "3",
                   "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2", "REGRESSIONS_QUEUED_GRACE_SECONDS": "3"})
    try:
        *_, token = process.manage_many(
            ("migrate", "-v0"), ("create_ingest_key", "--project", "default"),
            ("create_ingest_key", "--project", "other"),
            ("create_api_token", "--user", "ops", "--role", "operator", "--project", "default"))
        process.start(timeout=180)
        yield Live(process, token)
    finally:
        process.stop()
        if database:
            _drop_database(*database)




VLLM_FLEET = """\
name: tuning-vllm
run_dir: {run_dir}
gateway: {{bind: 127.0.0.1:{gateway}}}
control: {{bind: 127.0.0.1:{control}}}
replicas: {{host: 127.0.0.1, base_port: {replicas}}}
vllm: {{executable: {executable}}}
telemetry: {{otlp_protocol: grpc}}
groups:
  - name: real
    weight: 100
    replicas: 1
    backend: vllm
    served_model_name: tiny-llama
    config: {{model: {model}, gpu_type: CPU, max_num_seqs: 2, kv_cache_memory_bytes: 33554432}}
"""


@pytest.fixture(scope="module")
def vllm_live(tmp_path_factory, real_vllm_executable, tiny_model_dir):
    """A platform whose fleet's group `real` runs real vLLM (test_tuning_real_vllm.py; opt-in)."""
    root = tmp_path_factory.mktemp("tuning-vllm")
    fleet = root / "fleet.yaml"
    fleet.write_text(VLLM_FLEET.format(run_dir=root / "engine", gateway=free_port(), control=free_port(),
                                  replicas=free_port_pair(), executable=real_vllm_executable, model=tiny_model_dir))
    process = PlatformProcess(
        data_dir=str(root / "data"), args=("--with-engine",), grpc=True,  # vLLM exports its spans over gRPC only
        extra_env={"ENGINE_FLEET": str(fleet), "TUNING_SWEEP_INTERVAL_SECONDS": "2",
                   "TUNING_QUEUED_GRACE_SECONDS": "3", "TUNING_CONFIRM_MAX_RATE": "6", "TUNING_CONFIRM_ITEMS": "60",
                   "TUNING_SIM_REQUESTS": "200", "TUNING_RESCORE_CANDIDATES": "2", "TUNING_RESCORE_SEEDS": "3",
                   "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2", "REGRESSIONS_QUEUED_GRACE_SECONDS": "3"})
    try:
        *_, token = process.manage_many(
            ("migrate", "-v0"), ("create_ingest_key", "--project", "default"),
            ("create_api_token", "--user", "ops", "--role", "operator", "--project", "default"))
        process.start(timeout=300)
        yield Live(process, token)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def store():
    """A scratch ClickHouse store that traces.store.get_store() hands out for the module's tests."""
    from alerts_support import installed_store

    with installed_store() as scratch:
        yield scratch
