"""Real serving topologies: the official `openai` client under each real instrumentation → a real LiteLLM proxy →
the platform's gateway → simulated replicas, every hop exporting to a live platform.

The packages come from PyPI into a virtualenv of their own (`make stack`: litellm[proxy] 1.108, openai,
OpenLLMetry's and OpenInference's OpenAI instrumentors, the OTel GenAI one, the httpx one). LiteLLM runs with
`callbacks: ["otel"]` and `forward_traceparent_to_llm_provider: true`, as docs/connect-your-stack.md says.
Each call, streaming or not, must give exactly one request row with every hop in order and an exact sum.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from otlp_live_helpers import requests_for

REPO = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).resolve().parent / "stack_client.py"
MASTER_KEY = "sk-observatory-test-" + "0" * 32
SERVED = "llama"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def gateway(live_platform, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stack-fleet")
    bind = f"127.0.0.1:{_free_port()}"
    spec = {
        "name": "stack", "run_dir": str(run_dir), "gateway": {"bind": bind},
        "control": {"bind": f"127.0.0.1:{_free_port()}"}, "replicas": {"host": "127.0.0.1", "base_port": _free_port()},
        "telemetry": {"otlp_endpoint": f"{live_platform.url}/v1/traces", "otlp_protocol": "http/protobuf",
                      "otlp_headers": {"authorization": f"Bearer {live_platform.keys['alpha']}"}},
        "groups": [{"name": "baseline", "weight": 100, "replicas": 1, "backend": "simulator",
                    "served_model_name": SERVED, "config": {"gpu_type": "H100"}}],
    }
    fleet_file = run_dir / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "OTEL_"))}
    engine = [sys.executable, "-m", "engine"]
    started = subprocess.run(engine + ["up", "--detach", "--fleet", str(fleet_file)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"http://{bind}/v1"
    finally:
        subprocess.run(engine + ["down", "--fleet", str(fleet_file)], cwd=REPO, env=env, capture_output=True,
                       timeout=180)


@pytest.fixture(scope="module")
def litellm(stack_python, gateway, live_platform, tmp_path_factory):
    """A real LiteLLM proxy in front of the gateway, its OTel callback exporting to the platform, forwarding the
    traceparent it receives."""
    yield from _litellm(stack_python, gateway, live_platform, tmp_path_factory, forward=True)


@pytest.fixture(scope="module")
def litellm_default(stack_python, gateway, live_platform, tmp_path_factory):
    """The same with LiteLLM's default: no traceparent to the provider (the gateway starts a trace of its own)."""
    yield from _litellm(stack_python, gateway, live_platform, tmp_path_factory, forward=False)


def _litellm(stack_python, gateway, live_platform, tmp_path_factory, forward: bool):
    work = tmp_path_factory.mktemp("litellm")
    config = work / "litellm.yaml"
    settings = {"callbacks": ["otel"]}
    if forward:
        settings["forward_traceparent_to_llm_provider"] = True
    config.write_text(yaml.safe_dump({
        "model_list": [{"model_name": SERVED, "litellm_params": {
            "model": f"hosted_vllm/{SERVED}", "api_base": gateway, "api_key": "none"}}],
        "litellm_settings": settings,
    }))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({
        "OTEL_EXPORTER": "otlp_http", "OTEL_ENDPOINT": f"{live_platform.url}/v1/traces",
        "OTEL_HEADERS": f"Authorization=Bearer {live_platform.keys['alpha']}", "OTEL_SERVICE_NAME": "litellm-proxy",
        "LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1",
    })
    litellm_cli = str(Path(stack_python).parent / "litellm")
    log = open(work / "litellm.log", "wb")
    process = subprocess.Popen([litellm_cli, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                               env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (work / "litellm.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health/liveliness", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, (work / "litellm.log").read_text()[-3000:]
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _call(stack_python: str, live_platform, base_url: str, instrumentation: str, stream: bool) -> dict:
    argv = [stack_python, str(CLIENT), "--instrumentation", instrumentation, "--base-url", base_url + "/v1",
            "--model", SERVED, "--otlp-endpoint", f"{live_platform.url}/v1/traces",
            "--ingest-key", live_platform.keys["alpha"], "--api-key", MASTER_KEY]
    if stream:
        argv.append("--stream")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _the_four_hop_row(live_platform, trace_id: str) -> dict:
    """The one request row of ``trace_id``, once its four hops and the engine's figures are in (30 s at most)."""
    deadline = time.monotonic() + 30
    rows: list = []
    while time.monotonic() < deadline:
        rows = requests_for(live_platform.process, live_platform.tokens["alice"], trace_id)
        if len(rows) == 1 and len(rows[0]["hops"]) == 4 and rows[0]["queue_ms"] is not None:
            break
        time.sleep(0.25)
    assert len(rows) == 1, json.dumps(rows, indent=1)[:4000]
    return rows[0]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("instrumentation", ["openllmetry", "openinference", "genai"])
def test_openai_client_through_litellm_and_the_gateway_is_one_row(stack_python, live_platform, litellm,
                                                                  instrumentation, stream):
    answer = _call(stack_python, live_platform, litellm, instrumentation, stream)
    row = _the_four_hop_row(live_platform, answer["trace_id"])
    assert [(hop["role"], hop["service"]) for hop in row["hops"]] == [
        ("client", f"app-{instrumentation}"), ("gateway", "litellm-proxy"), ("gateway", "llm-gateway"),
        ("engine", "vllm")], json.dumps(row["hops"], indent=1)
    assert row["model"] == SERVED and row["status"] == "ok"
    # LiteLLM's own processing is split from the network by its call span (litellm_request), which was in flight
    # when the gateway's span started; the platform's gateway shows no call span: unattributed below it.
    client_hop, litellm_hop, gateway_hop, engine_hop = row["hops"]
    assert litellm_hop["network_ms"] is not None and litellm_hop["processing_ms"] is not None, row["hops"]
    assert gateway_hop["network_ms"] is not None and gateway_hop["unattributed_ms"] is None
    assert engine_hop["unattributed_ms"] is not None
    assert row["gateway_ms"] == pytest.approx(litellm_hop["processing_ms"])
    parts = [row[k] for k in ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")]
    assert all(p is not None for p in parts)
    assert sum(parts) + (row["gateway_ms"] or 0.0) == pytest.approx(row["e2e_ms"], abs=0.01)
    # The engine reports the response id the client received (chat completions: chatcmpl-…).
    assert answer["response_id"] and row["request_id"]
    assert row["engine_ttft_ms"] is not None
    # TTFT as the client saw it: OpenLLMetry and OpenInference put it on the span (event / attribute) when
    # streaming; opentelemetry-instrumentation-openai-v2 2.4 records it only as a metric, so the row has none
    # (never the gateway's in its place: that would understate what the client saw).
    assert (row["ttft_ms"] is not None) is (stream and instrumentation != "genai"), row["ttft_ms"]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("instrumentation", ["openllmetry", "openinference", "genai"])
def test_without_forwarding_the_two_traces_are_joined_by_the_response_id(stack_python, live_platform,
                                                                          litellm_default, instrumentation, stream):
    """LiteLLM's default: app + LiteLLM in the app's trace, gateway + engine in a trace of their own. The engine
    reports the id LiteLLM passed back (the client's response id): one row, all four hops, marked as joined."""
    answer = _call(stack_python, live_platform, litellm_default, instrumentation, stream)
    row = _the_four_hop_row(live_platform, answer["trace_id"])
    assert row["joined_by"] == "response_id", json.dumps(row, indent=1)[:4000]
    assert row["linked_trace_ids"] == [answer["trace_id"]] and row["trace_id"] != answer["trace_id"]
    assert [(hop["role"], hop["service"], hop["trace_id"]) for hop in row["hops"]] == [
        ("client", f"app-{instrumentation}", answer["trace_id"]),
        ("gateway", "litellm-proxy", answer["trace_id"]),
        ("gateway", "llm-gateway", row["trace_id"]), ("engine", "vllm", row["trace_id"])], json.dumps(row["hops"])
    litellm_hop = row["hops"][1]
    assert litellm_hop["processing_ms"] is not None and row["hops"][2]["network_ms"] is not None, row["hops"]
    parts = [row[k] for k in ("network_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms")]
    assert sum(parts) + (row["gateway_ms"] or 0.0) == pytest.approx(row["e2e_ms"], abs=0.01)
    assert row["request_id"] == answer["response_id"]
