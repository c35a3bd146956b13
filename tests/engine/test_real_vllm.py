"""Real vLLM (its CPU build, `make vllm`) in the managed fleet, decomposed by a live platform.

One fleet for the module: the gateway and one group of real `vllm serve` replicas serving the
test-size tiny Llama, exporting spans over OTLP/gRPC to a live platform (project alpha), as a
user's fleet would. Started once (~20-30 s); the tests then drive it as a user would: requests
through the gateway (streaming or not, greedy), a direct request to the replica, a client that
hangs up mid-stream, a config change with requests in flight, and kill -9 of the replica. The
metric names the platform reads are checked against the replicas' real /metrics.
"""
from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fleet_support import FleetPorts, exporting_to, fleet_control, group, run_engine, write_fleet
from otlp_live_helpers import requests_for

from engine.config import EngineConfig

# Real vLLM runs in the embedded suite only (two sets of vLLM processes on two cores would slow both suites).
pytestmark = pytest.mark.mode_independent(suite="embedded")

SERVED = "tiny-llama"
GROUP = "real"
CONFIG = {"gpu_type": "CPU", "max_num_seqs": 8, "kv_cache_memory_bytes": 32 * 1024 * 1024}
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# The new replica starts beside the old one serving three clients back to back, on the same two cores: its three
# processes' start (imports, engine core, worker) took 145 s of the replacement's 146 s on an AVX-512 host, against
# 26 s for the fixture's unloaded start; on an AVX2-only host the test took 217 s, and 245 s when a CI run timed out
# at 240. The fleet itself gives a vLLM replica 1,200 s to start (DEFAULT_STARTUP_TIMEOUT).
REPLACE_TIMEOUT = 480


class Fleet:
    def __init__(self, fleet_file: str, gateway: str, control: str, run_dir: Path, platform, model: str):
        self.fleet_file, self.gateway, self.control_url, self.run_dir = fleet_file, gateway, control, run_dir
        self.platform, self.model = platform, model

    def control(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        return fleet_control(self.control_url, self.run_dir, method, path, body)

    def replica(self) -> dict:
        [replica] = [r for r in self.control("GET", "/fleet")[1]["replicas"] if r["group"] == GROUP]
        return replica

    def rows(self, trace_id: str) -> list[dict]:
        return requests_for(self.platform.process, self.platform.tokens["alice"], trace_id)


@pytest.fixture(scope="module")
def fleet(real_vllm_executable, live_platform, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("real-vllm-fleet")
    ports = FleetPorts.free()
    fleet_file = write_fleet(
        run_dir / "fleet.yaml", name="real-vllm", run_dir=run_dir, ports=ports,
        groups=[group(GROUP, {"model": tiny_model_dir, **CONFIG}, backend="vllm", served_model_name=SERVED)],
        telemetry=exporting_to(live_platform.process, live_platform.keys["alpha"], grpc=True),
        vllm={"executable": real_vllm_executable},
        supervision={"health_interval": 0.5, "backoff_initial": 0.2, "backoff_max": 1.0, "terminate_grace": 10})
    started = run_engine(fleet_file, "up", "--detach", "--timeout", "300", timeout=400)
    assert started.returncode == 0, started.stdout + started.stderr + _tail(run_dir)
    try:
        yield Fleet(str(fleet_file), f"http://127.0.0.1:{ports.gateway}", f"http://127.0.0.1:{ports.control}", run_dir,
                    live_platform, tiny_model_dir)
    finally:
        stopped = run_engine(fleet_file, "down", timeout=180)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def _tail(run_dir: Path) -> str:
    out = []
    for log in sorted(run_dir.rglob("*.log")):
        out.append(f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    return "".join(out)


def _traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def _post(url: str, body: dict, headers: dict | None = None, timeout: float = 60) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 200
        return json.loads(response.read())


def _wait_rows(fleet: Fleet, trace_id: str, ready, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = fleet.rows(trace_id)
        if rows and ready(rows):
            return rows
        time.sleep(0.2)
    raise AssertionError(f"no decomposed row for trace {trace_id} within {timeout} s: {rows}")


def _complete(rows: list[dict]) -> bool:
    """One row with both hops joined (the gateway's and the engine's spans arrive independently)."""
    return len(rows) == 1 and rows[0]["queue_ms"] is not None and len(rows[0]["hops"]) == 2


def _engine_only(rows: list[dict]) -> bool:
    return len(rows) == 1 and rows[0]["queue_ms"] is not None


def _assert_decomposed(row: dict, *, outermost_network: bool, streaming: bool = True) -> None:
    assert row["model"] == SERVED
    assert row["replica_group"] == GROUP and row["engine_config"].startswith("cfg-")
    assert row["status"] == "ok"
    for figure in ("queue_ms", "prefill_ms", "decode_ms", "overhead_ms", "engine_ttft_ms", "e2e_ms"):
        assert row[figure] is not None, figure
    # TTFT as the outermost hop saw it: a non-streaming answer has no first token before the whole answer.
    assert (row["ttft_ms"] is not None) is streaming
    assert row["prefill_ms"] > 0 and row["decode_ms"] > 0 and row["e2e_ms"] > 0
    parts = [row[k] for k in ("queue_ms", "prefill_ms", "decode_ms", "overhead_ms")]
    if outermost_network:
        assert row["network_ms"] is not None
        parts.append(row["network_ms"])
    assert sum(parts) == pytest.approx(row["e2e_ms"], abs=0.01)


def test_greedy_request_through_the_gateway_is_decomposed(fleet):
    """Non-streaming, temperature 0 (vLLM leaves the temperature attribute out): gateway + engine in one row."""
    trace_id, traceparent = _traceparent()
    answer = _post(fleet.gateway + "/v1/chat/completions",
                   {"model": SERVED, "messages": [{"role": "user", "content": "How long is a piece of string?"}],
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True}, {"traceparent": traceparent})
    assert answer["usage"]["completion_tokens"] == 24
    [row] = _wait_rows(fleet, trace_id, _complete)
    _assert_decomposed(row, outermost_network=True, streaming=False)
    assert [hop["role"] for hop in row["hops"]] == ["gateway", "engine"]
    assert row["completion_tokens"] == 24 and row["prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert row["tpot_ms"] == pytest.approx(row["decode_ms"] / 23, rel=1e-6)
    # The gateway and the replica share the host: their gap is small but observed (never 0, never missing).
    assert row["network_ms"] > 0 and row["network_ms"] < row["e2e_ms"]


def test_a_shared_system_prompt_hits_the_prefix_cache_on_its_second_request(fleet):
    """The launcher starts vLLM with --enable-prompt-tokens-details: its usage says how many prompt tokens the prefix
    cache served, whole blocks of the shared system prompt on the second request, none on the first."""
    system = {"role": "system", "content": "You are the harbour master's assistant; answer with tide times. " * 30}
    usages, traces = [], []
    for question in ("When is high water?", "Which pilot boards at dawn?"):
        trace_id, traceparent = _traceparent()
        traces.append(trace_id)
        usages.append(_post(fleet.gateway + "/v1/chat/completions",
                            {"model": SERVED, "messages": [system, {"role": "user", "content": question}],
                             "max_tokens": 4, "temperature": 0}, {"traceparent": traceparent})["usage"])
    first, second = (usage["prompt_tokens_details"]["cached_tokens"] for usage in usages)
    block = EngineConfig.from_dict({"model": fleet.model, **CONFIG}).resolved().block_size
    assert first == 0 and 0 < second < usages[1]["prompt_tokens"] and second % block == 0, (usages, block)
    # vLLM's span has no cached-token attribute: the count reaches the request row through the gateway's span.
    rows = [_wait_rows(fleet, trace_id, _complete)[0] for trace_id in traces]
    assert [row["cached_prompt_tokens"] for row in rows] == [first, second]
    assert all(row["served_from"] == "engine" and row["lookup_ms"] is None for row in rows)


def test_streaming_request_through_the_gateway_is_decomposed(fleet):
    trace_id, traceparent = _traceparent()
    request = urllib.request.Request(
        fleet.gateway + "/v1/completions", method="POST", headers={"Content-Type": "application/json",
                                                                   "traceparent": traceparent},
        data=json.dumps({"model": SERVED, "prompt": "Once upon a time", "max_tokens": 32, "stream": True,
                         "ignore_eos": True, "temperature": 0.8}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line.decode().strip() for line in response if line.strip()]
    assert lines[-1] == "data: [DONE]" and len(lines) > 10
    [row] = _wait_rows(fleet, trace_id, _complete)
    _assert_decomposed(row, outermost_network=True)
    assert [hop["role"] for hop in row["hops"]] == ["gateway", "engine"] and row["completion_tokens"] == 32
    assert row["ttft_ms"] >= row["engine_ttft_ms"] > 0


def test_direct_request_takes_the_model_from_the_replica_resource(fleet):
    """No gateway hop: the engine span alone must say which model served it (resource llm_observatory.model)."""
    trace_id, traceparent = _traceparent()
    _post(fleet.replica()["url"] + "/v1/completions", {"model": SERVED, "prompt": "hello", "max_tokens": 4},
          {"traceparent": traceparent})
    [row] = _wait_rows(fleet, trace_id, _engine_only)
    assert row["model"] == SERVED and row["replica_group"] == GROUP
    assert row["network_ms"] is None  # the engine is the outermost hop: not observed, not 0


def test_client_gone_mid_stream_is_an_error_row_without_engine_figures(fleet):
    """vLLM emits no span for an aborted request: the gateway's hop is the row, status error, engine figures NULL."""
    trace_id, traceparent = _traceparent()
    host, port = fleet.gateway.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/completions", headers={"Content-Type": "application/json",
                                                           "traceparent": traceparent},
                       body=json.dumps({"model": SERVED, "prompt": "Tell me everything", "max_tokens": 1900,
                                        "stream": True, "ignore_eos": True}))
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data:")  # the stream has started
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    [row] = _wait_rows(fleet, trace_id, lambda rows: rows[0]["status"] == "error", timeout=30)
    assert row["model"] == SERVED and row["replica_group"] == GROUP
    for figure in ("queue_ms", "prefill_ms", "decode_ms", "overhead_ms", "engine_ttft_ms", "network_ms"):
        assert row[figure] is None, figure
    # The replica let the request go: nothing keeps running on it.
    assert _wait_until(lambda: _load(fleet.replica()["url"]) == 0, 15)


def test_start_up_trace_makes_no_request_row(fleet):
    """vLLM's INTERNAL start-up trace (Overall Loading → ... → Allocate KV cache) is stored, never a request."""
    from otlp_live_helpers import summary_total

    before = summary_total(fleet.platform.process, fleet.platform.tokens["alice"])
    trace_id, traceparent = _traceparent()
    _post(fleet.gateway + "/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 2},
          {"traceparent": traceparent})
    _wait_rows(fleet, trace_id, _complete)
    assert summary_total(fleet.platform.process, fleet.platform.tokens["alice"]) == before + 1


def test_metric_names_the_platform_reads_exist_on_real_vllm(fleet):
    from fleet.replica_metrics import SPEC_ACCEPTED_TOKENS, SPEC_DRAFT_TOKENS
    from prometheus_client.parser import text_string_to_metric_families
    from slo.prometheus import ERROR_MATCHER, HISTOGRAMS, LABEL_FOR_FILTER, SUCCESS_COUNTER, TPOT_HISTOGRAMS

    from engine.launcher.managed_process import LOAD_METRICS
    from engine.replica.metrics import SIMULATOR_PREFIX, ReplicaMetrics

    _post(fleet.gateway + "/v1/completions", {"model": SERVED, "prompt": "warm", "max_tokens": 4})
    real = _families(fleet.replica()["url"])
    # The drain check and the gateway's load reading.
    for name in LOAD_METRICS:
        assert real.get(name) == "gauge", name
    # The Prometheus rules the platform exports read vLLM's histograms and success counter, by model_name.
    for name in {name for name, _buckets in HISTOGRAMS.values()} | set(TPOT_HISTOGRAMS.values()):
        assert real.get(name) == "histogram", name
    assert real.get(SUCCESS_COUNTER.removesuffix("_total")) == "counter"
    text = _metrics_text(fleet.replica()["url"])
    assert f'{LABEL_FOR_FILTER["model"]}="{SERVED}"' in text
    assert ERROR_MATCHER.split("=")[0] + "=" in text  # success counter's finished_reason label
    # The simulator's replicas export the same families with the same types as real vLLM (spec-decode aside:
    # checked after the config change below, on a replica that speculates).
    simulated = {family.name: family.type for family in text_string_to_metric_families(
        _generate(ReplicaMetrics(EngineConfig(), model_name=SERVED).registry))}
    # Beyond vLLM's, the simulator's own families (how far its real-time loop keeps pace) say what they are by name.
    assert all(name.startswith(("vllm:", SIMULATOR_PREFIX)) for name in simulated), simulated
    missing = {name: kind for name, kind in simulated.items() if real.get(name) != kind
               and not name.startswith(("vllm:spec_decode", SIMULATOR_PREFIX))}
    assert not missing, f"the simulator exports families real vLLM does not (or with another type): {missing}"
    # The diagnosis's spec-decode counters exist only on a speculating replica.
    assert SPEC_ACCEPTED_TOKENS.removesuffix("_total") not in real and SPEC_DRAFT_TOKENS.removesuffix("_total") \
        not in real


def test_config_change_with_requests_in_flight_then_spec_decode_metrics(fleet):
    """Drain-and-replace to n-gram speculation while requests run: none fails; the new replica speculates."""
    from fleet.replica_metrics import SPEC_ACCEPTED_TOKENS, SPEC_DRAFT_TOKENS, speculative_acceptance

    old = fleet.replica()
    stop = threading.Event()
    outcomes: list[str] = []

    def client(index: int) -> None:
        while not stop.is_set():
            try:
                answer = _post(fleet.gateway + "/v1/completions",
                               {"model": SERVED, "prompt": f"client {index} says the same words again and again",
                                "max_tokens": 48, "ignore_eos": True}, timeout=120)
                outcomes.append("ok" if answer["usage"]["completion_tokens"] == 48 else f"short: {answer}")
            except Exception as exc:  # reported by the assertion below
                outcomes.append(repr(exc))

    clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in clients:
        thread.start()
    try:
        _wait_until(lambda: len(outcomes) >= 3, 30)
        status, answer = fleet.control("PUT", f"/fleet/groups/{GROUP}/config",
                                       {"config": {"model": fleet.model, **CONFIG,
                                                   "speculative_config": SPEC_CONFIG}})
        assert status == 202, answer
        done = _wait_for_transition(fleet, REPLACE_TIMEOUT)
        during = len(outcomes)
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in clients:
            thread.join(120)
    assert done["last_transition"]["phase"] == "done", done["last_transition"]
    assert during > 5 and all(outcome == "ok" for outcome in outcomes), [o for o in outcomes if o != "ok"]
    new = fleet.replica()
    assert new["config_version"] == done["last_transition"]["to_version"] != old["config_version"]
    assert new["pid"] != old["pid"]
    # Greedy decoding of a random-weight model falls into loops, which n-gram lookup then drafts from.
    _post(new["url"] + "/v1/completions", {"model": SERVED, "prompt": "one two three " * 20, "max_tokens": 96,
                                            "temperature": 0, "ignore_eos": True})
    real = _families(new["url"])
    assert real.get(SPEC_ACCEPTED_TOKENS.removesuffix("_total")) == "counter"
    assert real.get(SPEC_DRAFT_TOKENS.removesuffix("_total")) == "counter"
    acceptance = speculative_acceptance([new["url"]])
    assert acceptance is not None and 0 <= acceptance <= 1, acceptance


def test_replica_killed_with_sigkill_is_restarted(fleet):
    old = fleet.replica()
    # The replica's log (its start line prints the launch command) never shows the ingest key.
    for log in (fleet.run_dir / "logs").glob("*.log"):
        assert fleet.platform.keys["alpha"] not in log.read_text(errors="replace"), log
    os.kill(old["pid"], signal.SIGKILL)
    restarted = _wait_until(lambda: (lambda r: r if r["pid"] != old["pid"] and r["state"] == "healthy" else None)(
        fleet.replica()), 180)
    assert restarted["restarts"] == old["restarts"] + 1 and restarted["last_exit_code"] == -signal.SIGKILL
    # The restarted replica serves its first request. (On AMX hosts vLLM's CPU worker died with SIGILL on its first
    # forward pass until `make vllm` installed engine/launcher/vllm_amx_permission.py into its virtualenv.) The
    # gateway's own probes are 5 s apart and may still hold the replica out of rotation: finding no replica in
    # rotation, the request has the gateway probe it at once (a CI run once got a 503 here, before that recheck).
    trace_id, traceparent = _traceparent()
    try:
        _post(fleet.gateway + "/v1/completions", {"model": SERVED, "prompt": "back", "max_tokens": 4},
              {"traceparent": traceparent})
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        logs = "".join(log.read_text(errors="replace") for log in (fleet.run_dir / "logs").glob("*.log"))
        raise AssertionError(f"{exc.code}: {body[:2000]}\n--- replica logs (tail) ---\n{logs[-6000:]}") from None
    assert fleet.replica()["restarts"] == old["restarts"] + 1
    [row] = _wait_rows(fleet, trace_id, _complete)
    assert row["status"] == "ok" and row["model"] == SERVED


# ---------------------------------------------------------------------------------------------- helpers
def _wait_for_transition(fleet: Fleet, timeout: float) -> dict:
    """The group once its replacement ended; on a timeout, how long each phase took and the replicas' logs."""
    began = time.monotonic()
    phases: list[tuple[float, str]] = []
    while time.monotonic() - began < timeout:
        group = fleet.control("GET", "/fleet")[1]["groups"][0]
        if group["last_transition"]:
            print(f"replacement phases (seconds, phase): {phases}, ended at {time.monotonic() - began:.1f} s")
            return group
        phase = (group["transition"] or {}).get("phase")
        if not phases or phases[-1][1] != phase:
            phases.append((round(time.monotonic() - began, 1), phase))
        time.sleep(0.25)
    raise AssertionError(f"the replacement did not end within {timeout} s; phases (seconds, phase): {phases}"
                         + _tail(fleet.run_dir))


def _wait_until(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s")


def _metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return response.read().decode()


def _families(url: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family.type for family in text_string_to_metric_families(_metrics_text(url))}


def _generate(registry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def _load(url: str) -> int:
    from engine.launcher.managed_process import parse_load

    return parse_load(_metrics_text(url)) or 0
