"""Real vLLM (its CPU build) sending spans to a live platform: start-to-healthy, and request end → decomposed row.

    python -m observatory.bench.vllm [--requests 40] [--model DIR]

Starts a platform (`manage.py runplatform` with OTLP/gRPC) and one real `vllm serve`
replica with the launcher's command (the test-size tiny model, built in a scratch
directory unless ``--model`` names one), exporting to the platform with an ingest key, as
a fleet does. Then, one request at a time with a fresh ``traceparent``, it measures the
time from the end of the response to the moment ``GET /api/v1/requests?trace_id=…``
returns the decomposed row (engine figures present), polling every 20 ms. Prints:

    BENCH vllm_start_to_healthy_s=…                (process start → /health 200)
    BENCH vllm_request_to_row_p50_s=…, _p95_s, _max_s   (target ≤ 2 s)

Needs `make vllm`.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchkit.harness import PlatformProcess, free_port

from engine import tiny_model
from engine.config import EngineConfig
from engine.launcher.vllm_command import find_vllm_executable, render_vllm_command


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m observatory.bench.vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--model", default=None, help="model directory (default: a fresh test-size tiny model)")
    args = parser.parse_args(argv)
    executable = find_vllm_executable()
    if executable is None:
        print("error: vLLM is not installed: run `make vllm`", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = args.model or str(tiny_model.build(scratch / "model", "test"))

    platform = PlatformProcess(grpc=True)
    key, token = platform.setup()
    platform.start()
    port = free_port()
    config = EngineConfig(model=model, gpu_type="CPU", max_num_seqs=8, kv_cache_memory_bytes=32 * 1024 * 1024)
    command = render_vllm_command(config, host="127.0.0.1", port=port, served_model_name="tiny-llama",
                                  otlp_traces_endpoint=f"127.0.0.1:{platform.grpc_port}",
                                  otlp_headers={"authorization": f"Bearer {key}"}, group="bench",
                                  vllm_executable=executable)
    log = open(scratch / "vllm.log", "wb")
    started = time.monotonic()
    process = subprocess.Popen(list(command.argv), env={**os.environ, **command.env}, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if process.poll() is not None:
                print(f"error: vllm exited with {process.returncode}; see {scratch / 'vllm.log'}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - started > 300:
                print("error: vllm was not healthy within 300 s", file=sys.stderr)
                return 1
            time.sleep(0.1)
        healthy = time.monotonic() - started
        delays: list[float] = []
        for index in range(args.requests):
            trace_id = secrets.token_hex(16)
            request = urllib.request.Request(
                base + "/v1/completions", method="POST",
                data=json.dumps({"model": "tiny-llama", "prompt": f"request {index}", "max_tokens": 16,
                                 "ignore_eos": True}).encode(),
                headers={"Content-Type": "application/json",
                         "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                answer.read()
            ended = time.monotonic()
            while True:
                status, body = platform.get(f"/api/v1/requests?trace_id={trace_id}", token)
                if status == 200 and body["requests"] and body["requests"][0]["queue_ms"] is not None:
                    delays.append(time.monotonic() - ended)
                    break
                if time.monotonic() - ended > 30:
                    print(f"error: no row for trace {trace_id} after 30 s", file=sys.stderr)
                    return 1
                time.sleep(0.02)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
        platform.stop()
    print(f"# real vLLM {command.argv[0]} (CPU build), test-size tiny model; {len(delays)} requests one at a time, "
          "each row polled every 20 ms")
    print(f"BENCH vllm_start_to_healthy_s={healthy:.1f} s")
    print(f"BENCH vllm_request_to_row_p50_s={_percentile(delays, 50):.2f} s")
    print(f"BENCH vllm_request_to_row_p95_s={_percentile(delays, 95):.2f} s")
    print(f"BENCH vllm_request_to_row_max_s={max(delays):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
