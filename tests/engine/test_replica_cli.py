"""``python -m engine.replica`` as a process: serves, exports spans over OTLP like vLLM, stops cleanly on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from replica_harness import get, post, wait_until

from engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _OtlpReceiver:
    """A minimal OTLP/HTTP endpoint recording each export request and its headers."""

    def __init__(self):
        self.requests: list[tuple[dict, ExportTraceServiceRequest]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                message = ExportTraceServiceRequest()
                message.ParseFromString(self.rfile.read(length))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, message))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self):
        for headers, message in self.requests:
            for resource_spans in message.resource_spans:
                resource = {kv.key: kv.value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        yield headers, resource, span

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _environment(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_process_serves_exports_spans_over_otlp_http_and_stops_on_sigterm(tmp_path):
    receiver = _OtlpReceiver()
    config = EngineConfig(max_num_seqs=8)
    config_file = tmp_path / "engine.json"
    config_file.write_text(json.dumps(config.to_dict()))
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.replica", "--config", str(config_file), "--host", "127.0.0.1",
         "--port", str(port), "--group", "canary", "--served-model-name", "llama", "--seed", "3",
         "--otlp-traces-endpoint", receiver.url, "--enable-prompt-tokens-details"],
        cwd=REPO,
        env=_environment(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
                         OTEL_EXPORTER_OTLP_TRACES_HEADERS="authorization=Bearer%20ingest-key"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            try:
                return get(url + "/health", timeout=1).status == 200
            except OSError:
                return False

        assert wait_until(healthy, timeout=20), "replica did not become healthy"
        reply = post(url + "/v1/chat/completions",
                     {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert reply.status == 200, reply.body
        request_id = reply.json()["id"]
        assert reply.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
        assert process.returncode == 0, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        receiver.close()

    spans = [(headers, resource, span) for headers, resource, span in receiver.spans() if span.name == "llm_request"]
    assert len(spans) == 1, "the span must be exported, at the latest when the replica stops"
    headers, resource, span = spans[0]
    assert headers["authorization"] == "Bearer ingest-key"
    assert resource["service.name"].string_value == "vllm"
    assert resource["llm_observatory.simulated"].bool_value is True
    assert resource["llm_observatory.replica_group"].string_value == "canary"
    assert resource["llm_observatory.engine_config"].string_value == config.version
    attributes = {kv.key: kv.value for kv in span.attributes}
    assert attributes["gen_ai.request.id"].string_value == request_id
    # As vLLM 0.32: no gen_ai.response.model on the span; the served model is on the resource.
    assert "gen_ai.response.model" not in attributes
    assert resource["llm_observatory.model"].string_value == "llama"
    assert attributes["gen_ai.latency.e2e"].double_value > 0
    assert attributes["gen_ai.usage.cache_read.input_tokens"].WhichOneof("value") == "int_value"
    assert span.kind == 2  # SPAN_KIND_SERVER


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"max_num_seqs": 0}', "max_num_seqs must be an integer >= 1"),
        ('{"no_such_knob": 1}', "unknown engine config key 'no_such_knob'"),
        ("model: [unclosed", "not valid YAML"),
    ],
)
def test_invalid_config_exits_2_with_the_reason(tmp_path, content, fragment):
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(content)
    done = subprocess.run([sys.executable, "-m", "engine.replica", "--config", str(config_file), "--port", "0"],
                          cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert fragment in done.stderr


def test_missing_config_and_bad_flags_exit_2(tmp_path):
    from engine.replica.cli import main

    assert main(["--config", str(tmp_path / "absent.yaml")]) == 2
    with pytest.raises(SystemExit) as excinfo:
        main(["--config", "x.yaml", "--port", "70000"])
    assert excinfo.value.code == 2
    with pytest.raises(SystemExit):
        main(["--config", "x.yaml", "--shutdown-timeout", "-1"])


@pytest.mark.parametrize(("value", "fragment"), [
    ("{not json", "ENGINE_SIM_HARDWARE is not JSON"),
    ('{"hbm_bandwidth": 1}', "'hbm_bandwidth' is not a constant one may set"),
    ('{"mfu": -0.5}', "mfu must be a non-negative number"),
    ("[0.5]", "must be a JSON object of constants"),
])
def test_a_bad_hardware_override_exits_2_with_the_reason(tmp_path, value, fragment):
    config_file = tmp_path / "engine.json"
    config_file.write_text('{"model": "meta-llama/Llama-3.1-8B-Instruct"}')
    done = subprocess.run([sys.executable, "-m", "engine.replica", "--config", str(config_file), "--port", "0"],
                          cwd=REPO, env={**_environment(), "ENGINE_SIM_HARDWARE": value}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert fragment in done.stderr


def test_a_hardware_override_replaces_the_published_constants():
    from engine.config import EngineConfig
    from engine.replica.app import hardware_override
    from engine.sim.profiles import hardware_profile

    config = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu_type="L4")
    os.environ["ENGINE_SIM_HARDWARE"] = '{"mfu": 0.3, "step_overhead": 0.002}'
    try:
        profile = hardware_override(config)
    finally:
        del os.environ["ENGINE_SIM_HARDWARE"]
    published = hardware_profile("L4")
    assert (profile.mfu, profile.step_overhead) == (0.3, 0.002)
    assert profile.bandwidth_efficiency == published.bandwidth_efficiency and profile.name == "L4"
    assert hardware_override(config) is None
