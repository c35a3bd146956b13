"""A live platform with a simulated fleet of three replica groups for regression runs:

- `base`: Llama-3.1-8B on one H100 with vLLM's defaults (weight 100: the background traffic, if any);
- `same`: the same config (weight 0: reached only through the X-Engine-Group header), for A/A runs;
- `slow`: the same with max_num_seqs 2 (weight 0): under concurrent load its requests wait in the queue.

The platform runs the fleet itself (`runplatform --with-engine`, ENGINE_FLEET), as `make up` does; in server
mode it gets a PostgreSQL database of its own."""
from __future__ import annotations

import json
import urllib.request

import pytest
from observatory.bench.harness import PlatformProcess, free_port, free_port_pair
from otlp_live_helpers import _drop_database, _server_mode_database

FLEET = """\
name: regressions-test
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
    config: {{model: meta-llama/Llama-3.1-8B-Instruct, gpu_type: H100, tensor_parallel_size: 1}}
  - name: same
    weight: 0
    replicas: 1
    backend: simulator
    config: {{model: meta-llama/Llama-3.1-8B-Instruct, gpu_type: H100, tensor_parallel_size: 1}}
  - name: slow
    weight: 0
    replicas: 1
    backend: simulator
    config: {{model: meta-llama/Llama-3.1-8B-Instruct, gpu_type: H100, tensor_parallel_size: 1, max_num_seqs: 2}}
"""


class Live:
    def __init__(self, process: PlatformProcess, token: str, gateway: int, keys: dict[str, str]):
        self.process = process
        self.token = token
        self.gateway = gateway
        self.keys = keys  # ingest keys by project

    def api(self, method: str, path: str, body=None, token: str | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.process.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="package")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("regressions")
    gateway, control, replicas = free_port(), free_port(), free_port_pair()
    fleet = root / "fleet.yaml"
    fleet.write_text(FLEET.format(run_dir=root / "engine", gateway=gateway, control=control,
                                  replicas=replicas))
    database = _server_mode_database()
    process = PlatformProcess(
        data_dir=str(root / "data"), args=("--with-engine",), grpc=True,
        extra_env={**({"DATABASE_URL": database[1]} if database else {}), "ENGINE_FLEET": str(fleet),
                   "REGRESSIONS_STALE_SECONDS": "6", "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2",
                   "REGRESSIONS_QUEUED_GRACE_SECONDS": "3"})
    try:
        _, default, other, token = process.manage_many(
            ("migrate", "-v0"), ("create_ingest_key", "--project", "default"),
            ("create_ingest_key", "--project", "other"),
            ("create_api_token", "--user", "ops", "--role", "operator", "--project", "default"))
        keys = {"default": default, "other": other}
        process.start(timeout=180)
        yield Live(process, token, gateway, keys)
    finally:
        process.stop()
        if database:
            _drop_database(*database)
