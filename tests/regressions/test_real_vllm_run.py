"""A regression run against a real vLLM replica (its CPU build, `make vllm`, serving the test-size tiny Llama):
its requests are decomposed from vLLM's own llm_request spans (queue, prefill, decode, overhead) and its
outputs scored. Skipped without vLLM unless OBSERVATORY_REQUIRE_VLLM=1 (CI's embedded-mode suite)."""
from __future__ import annotations

import os
import time

import pytest
from fleet_support import FleetPorts, exporting_to, group, run_engine, write_fleet


@pytest.fixture(scope="module")
def vllm_fleet(real_vllm_executable, live, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("regression-vllm")
    ports = FleetPorts.free()
    config = {"model": tiny_model_dir, "gpu_type": "CPU", "max_num_seqs": 8, "kv_cache_memory_bytes": 32 * 1024 * 1024}
    fleet_file = write_fleet(run_dir / "fleet.yaml", name="regression-vllm", run_dir=run_dir, ports=ports,
                             groups=[group("real", config, backend="vllm", served_model_name="tiny-llama")],
                             telemetry=exporting_to(live.process, live.keys["default"], grpc=True),
                             vllm={"executable": real_vllm_executable})
    started = run_engine(fleet_file, "up", "--detach", "--timeout", "300", timeout=400, env=os.environ)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"http://127.0.0.1:{ports.gateway}/v1"
    finally:
        run_engine(fleet_file, "down", env=os.environ)


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
