"""Through real sockets: load generator → gateway → two simulated replica groups → the platform's OTLP receiver.

The platform's decomposition of each request must agree with what the load generator
measured (e2e, TTFT) and with what the simulator reported (queue/prefill/decode),
within 5 ms, and both replica groups must carry traffic under their own config version.
"""
from __future__ import annotations

import time

import pytest
from fleet_support import FleetPorts, exporting_to, group, run_engine, write_fleet
from otlp_live_helpers import requests_for

from engine.config import EngineConfig
from engine.loadgen import LengthRange, LoadSpec, run_load_sync
from engine.telemetry import build_tracer_provider

BASELINE = {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "H100"}
CANARY = {**BASELINE, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def fleet(live_platform, tmp_path_factory):
    """A simulated fleet of two groups (50/50) exporting its spans to the live platform (project alpha)."""
    run_dir = tmp_path_factory.mktemp("fleet")
    ports = FleetPorts.free()
    fleet_file = write_fleet(run_dir / "fleet.yaml", name="e2e", run_dir=run_dir, ports=ports,
                             groups=[group("baseline", BASELINE, weight=50), group("canary", CANARY, weight=50)],
                             telemetry=exporting_to(live_platform.process, live_platform.keys["alpha"]))
    started = run_engine(fleet_file, "up", "--detach", timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"http://127.0.0.1:{ports.gateway}/v1"
    finally:
        stopped = run_engine(fleet_file, "down", timeout=180)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_decomposition_matches_client_and_simulator(live_platform, fleet):
    provider = build_tracer_provider(
        "llm-loadgen", endpoint=f"{live_platform.url}/v1/traces", protocol="http/protobuf",
        headers={"authorization": f"Bearer {live_platform.keys['alpha']}"},
    )
    spec = LoadSpec(base_url=fleet, arrival="constant", rate=8.0, num_requests=24,
                    input_len=LengthRange(200, 200), output_len=LengthRange(24, 24), seed=3, timeout=60)
    result = run_load_sync(spec, tracer_provider=provider)
    provider.force_flush()
    provider.shutdown()
    records = [r for r in result.records if r.success]
    assert len(records) == 24, [r.error for r in result.records if not r.success]

    token = live_platform.tokens["alice"]
    rows: dict[str, dict] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(rows) < len(records):
        for record in records:
            if record.trace_id in rows:
                continue
            found = requests_for(live_platform.process, token, record.trace_id)
            if len(found) == 1 and len(found[0]["hops"]) == 3 and found[0]["queue_ms"] is not None:
                rows[record.trace_id] = found[0]
        time.sleep(0.25)
    assert len(rows) == len(records), f"only {len(rows)} of {len(records)} requests were decomposed in time"

    versions = {EngineConfig.from_dict(BASELINE).version, EngineConfig.from_dict(CANARY).version}
    seen_versions = set()
    for record in records:
        row = rows[record.trace_id]
        assert [hop["role"] for hop in sorted(row["hops"], key=lambda h: h["start_ns"])] == [
            "client", "gateway", "engine"]
        # What the load generator measured is what the platform reports for the outermost hop.
        assert row["e2e_ms"] == pytest.approx(record.e2e_ms, abs=5)
        assert row["ttft_ms"] == pytest.approx(record.ttft_ms, abs=5)
        assert row["completion_tokens"] == record.completion_tokens == 24
        assert row["prompt_tokens"] == record.prompt_tokens
        # The parts add up, none is missing, and time spent outside the engine is real but small.
        parts = [row[k] for k in ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")]
        assert all(p is not None and p >= -0.5 for p in parts), row
        assert sum(parts) == pytest.approx(row["e2e_ms"], abs=0.05)
        # Small on an idle machine (a few ms); a loaded CI host has stalled a request's hop by 0.4 s.
        assert 0 <= row["network_ms"] < 1000
        assert row["engine_ttft_ms"] <= row["ttft_ms"] + 0.5
        # vLLM's TPOT definition on the engine's decode time.
        assert row["tpot_ms"] == pytest.approx(row["decode_ms"] / 23, rel=1e-3)
        assert row["engine_config"] in versions
        seen_versions.add(row["engine_config"])
    assert seen_versions == versions, "both replica groups should have served some of the 24 requests"


def test_platform_reports_fleet_state(live_platform):
    """``GET /api/v1/engine`` needs a token; with no controller for the platform's fleet it says so."""
    status, body = live_platform.process.get("/api/v1/engine")
    assert status == 401 and "error" in body
    status, body = live_platform.process.get("/api/v1/engine", live_platform.tokens["alice"])
    assert status == 200
    assert body["running"] is False and body["fleet"] is None
