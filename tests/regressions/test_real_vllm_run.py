"""A regression run against a real vLLM replica (its CPU build, `make vllm`, serving the test-size tiny Llama):
its requests are decomposed from vLLM's own llm_request spans (queue, prefill, decode, overhead) and its
outputs scored. Skipped without vLLM unless OBSERVATORY_REQUIRE_VLLM=1 (CI's embedded-mode suite)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from observatory.bench.harness import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vllm_fleet(real_vllm_executable, live, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("regression-vllm")
    gateway = f"127.0.0.1:{free_port()}"
    spec = {
        "name": "regression-vllm", "run_dir": str(run_dir), "gateway": {"bind": gateway},
        "control": {"bind": f"127.0.0.1:{free_port()}"},
        "replicas": {"host": "127.0.0.1", "base_port": free_port()},
        "vllm": {"executable": real_vllm_executable},
        "telemetry": {"otlp_endpoint": f"127.0.0.1:{live.process.grpc_port}", "otlp_protocol": "grpc",
                      "otlp_headers": {"authorization": f"Bearer {live.keys['default']}"}},
        "groups": [{"name": "real", "weight": 100, "replicas": 1, "backend": "vllm", "served_model_name": "tiny-llama",
                    "config": {"model": tiny_model_dir, "gpu_type": "CPU", "max_num_seqs": 8,
                               "kv_cache_memory_bytes": 32 * 1024 * 1024}}],
    }
    fleet_file = run_dir / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(spec))
    command = [sys.executable, "-m", "engine"]
    started = subprocess.run([*command, "up", "--fleet", str(fleet_file), "--detach", "--timeout", "300"], cwd=REPO,
                             capture_output=True, text=True, timeout=400)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"http://{gateway}/v1"
    finally:
        subprocess.run([*command, "down", "--fleet", str(fleet_file)], cwd=REPO, capture_output=True, timeout=180)


def test_a_run_against_real_vllm_is_decomposed_and_scored(live, vllm_fleet):
    items = [{"id": f"v{i}", "prompt": "The quick brown fox " * (2 + i), "params": {"max_tokens": 8 + i},
              "evaluators": [{"type": "regex", "pattern": "."}, {"type": "json"}]} for i in range(8)]
    status, body = live.api("POST", "/api/v1/datasets", {"name": "real-vllm", "items": items})
    assert status == 201, body
    status, run = live.api("POST", "/api/v1/regression-runs",
                           {"dataset": "real-vllm", "target": vllm_fleet, "options": {"max_concurrency": 4}})
    assert status == 201, run
    deadline = time.monotonic() + 240
    while run["state"] in ("queued", "running", "analysing"):
        assert time.monotonic() < deadline, run
        time.sleep(0.5)
        run = live.api("GET", f"/api/v1/regression-runs/{run['id']}")[1]
    assert run["state"] == "done", run
    assert run["synthetic"] is False and run["summary"]["rows_found"] == 8, run["summary"]
    status, results = live.api("GET", f"/api/v1/regression-runs/{run['id']}/results")
    for result in results["results"]:
        assert result["success"] and result["row_found"], result
        metrics = result["metrics"]
        for key in ("queue_ms", "prefill_ms", "decode_ms", "overhead_ms", "engine_ttft_ms", "network_ms"):
            assert metrics.get(key) is not None, (key, metrics)
        assert metrics["e2e_ms"] == pytest.approx(
            sum(metrics.get(k) or 0 for k in ("network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms",
                                              "decode_ms")), abs=0.01)
        assert set(result["scores"]) == {"regex", "json"} and result["completion_tokens"] >= 1
        assert result["output"]
    status, rows = live.api("GET", f"/api/v1/requests?trace_id={results['results'][0]['trace_id']}")
    assert [h["role"] for h in rows["requests"][0]["hops"]] == ["client", "gateway", "engine"]
    assert rows["requests"][0]["hops"][2]["service"] == "vllm" or rows["requests"][0]["hops"][2]["name"] == "llm_request"
