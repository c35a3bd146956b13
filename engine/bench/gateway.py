"""Benchmark of the latency the gateway adds to streaming requests: the same load sent directly and through it.

    python -m engine.bench.gateway [--requests 200] [--chunks 64] [--pace-ms 20] [--rounds 2]

Three processes, as in production: a fast streaming upstream (a vLLM stand-in emitting
``--chunks`` chunks at a fixed pace, on its own schedule so its timing does not drift
with load), the gateway (``python -m engine.gateway``) and this load client. Each round
sends ``--requests`` concurrent streaming chat requests directly to the upstream, then
the same through the gateway.

The upstream reports its own view of each request (arrival to first chunk and to last
chunk) in a closing SSE comment. For each request the client subtracts it from what it
observed, which leaves the time spent outside the upstream: client, network and, via the
gateway, the gateway. A request's added latency is that residual minus the median
residual of the direct requests; the figures printed are its percentiles:

    BENCH gateway_overhead_p50_ms=… ms        (end to end)
    BENCH gateway_overhead_p99_ms=… ms
    BENCH gateway_ttft_overhead_p50_ms=… ms   (time to first chunk)
    BENCH gateway_ttft_overhead_p99_ms=… ms

On a machine with few cores the three processes compete for CPU, so the figures include
some scheduling noise; they are an upper bound of the gateway's own cost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

MODEL = "bench-model"
_REPORT = re.compile(rb": upstream ttft_s=([0-9.e-]+) e2e_s=([0-9.e-]+)")
_STARTUP_TIMEOUT_S = 20.0


# --- the upstream (its own process) ---------------------------------------------------------------------------

def _upstream_app(chunks: int, pace_s: float) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await request.json()
        number = id(request)
        base = {"id": f"chatcmpl-bench-{number}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": MODEL}
        if not body.get("stream"):
            await asyncio.sleep(chunks * pace_s)
            return web.json_response(dict(base, object="chat.completion", choices=[
                {"index": 0, "message": {"role": "assistant", "content": "x" * chunks}, "finish_reason": "length"}]))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        first = None
        for index in range(chunks):
            # A fixed schedule from arrival, like a decode loop: late wake-ups do not push later chunks back.
            delay = arrival + (index + 1) * pace_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            chunk = dict(base, choices=[{"index": 0, "delta": {"content": f" tok{index}"}, "logprobs": None,
                                         "finish_reason": "length" if index == chunks - 1 else None}])
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if first is None:
                first = time.perf_counter()
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = dict(base, choices=[], usage={"prompt_tokens": 16, "completion_tokens": chunks,
                                                  "total_tokens": 16 + chunks})
            await response.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        end = time.perf_counter()
        await response.write(f": upstream ttft_s={first - arrival:.6f} e2e_s={end - arrival:.6f}\n\n".encode()
                             + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


async def _serve_upstream(chunks: int, pace_s: float) -> None:
    runner = web.AppRunner(_upstream_app(chunks, pace_s), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
    print(f"PORT {runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()


# --- the load client ------------------------------------------------------------------------------------------

async def _one(session: aiohttp.ClientSession, url: str, chunks: int) -> tuple[float, float]:
    """(client TTFT − upstream TTFT, client e2e − upstream e2e) in seconds for one streaming request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "benchmark"}], "stream": True,
            "max_tokens": chunks}
    started = time.perf_counter()
    first = None
    tail = b""
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:200]}")
        async for data in resp.content.iter_any():
            if first is None and b"data: " in data:
                first = time.perf_counter()
            tail = (tail + data)[-512:]
    ended = time.perf_counter()
    report = _REPORT.search(tail)
    if first is None or report is None:
        raise RuntimeError(f"{url}: stream ended without chunks or without the upstream's timing report")
    upstream_ttft, upstream_e2e = float(report.group(1)), float(report.group(2))
    return (first - started) - upstream_ttft, (ended - started) - upstream_e2e


async def _streams(session: aiohttp.ClientSession, url: str, concurrency: int, per_stream: int, chunks: int,
                   stream_s: float, seed: int) -> list[tuple[float, float]]:
    """``concurrency`` closed-loop workers, each sending ``per_stream`` requests back to back.

    Workers start at offsets spread over one stream's duration, so about ``concurrency``
    streams are in flight at any time with arrivals spread evenly, as under steady traffic
    (released all in the same millisecond, a burst would measure queueing in each process
    instead). Each worker's first request is a warm-up and is not kept.
    """
    rng = random.Random(seed)

    async def worker() -> list[tuple[float, float]]:
        await asyncio.sleep(rng.uniform(0, stream_s))
        results = [await _one(session, url, chunks) for _ in range(per_stream + 1)]
        return results[1:]

    return [sample for samples in await asyncio.gather(*(worker() for _ in range(concurrency)))
            for sample in samples]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def _measure(upstream_url: str, gateway_url: str, concurrency: int, chunks: int, pace_s: float,
                   per_stream: int):
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    stream_s = chunks * pace_s
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        direct = await _streams(session, upstream_url, concurrency, per_stream, chunks, stream_s, seed=1)
        via_gateway = await _streams(session, gateway_url, concurrency, per_stream, chunks, stream_s, seed=1)
    return direct, via_gateway


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    # stderr goes to a file, not a pipe: an undrained pipe that fills up would stall the child mid-benchmark.
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    process.log = log
    return process


def _read_line(process: subprocess.Popen, pattern: str, what: str) -> re.Match:
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        match = re.search(pattern, line)
        if match:
            return match
    process.log.seek(0)
    raise RuntimeError(f"{what} did not start: {process.log.read()[-2000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    process.stdout.close()
    process.log.close()


async def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never became healthy")


def run_benchmark(concurrency: int, chunks: int, pace_ms: float, per_stream: int) -> dict[str, float]:
    """Start upstream and gateway processes, measure, stop them; returns the figures in milliseconds."""
    # No span export from the benchmark's gateway (spans are still created, as in production).
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    upstream = _start([sys.executable, "-m", "engine.bench.gateway", "--serve-upstream", "--chunks", str(chunks),
                       "--pace-ms", str(pace_ms)], env)
    gateway = None
    try:
        port = int(_read_line(upstream, r"^PORT (\d+)", "upstream").group(1))
        upstream_url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryDirectory() as folder:
            routes = Path(folder) / "routes.json"
            routes.write_text(json.dumps([{"name": "bench", "weight": 1, "upstreams": [upstream_url]}]))
            gateway = _start([sys.executable, "-m", "engine.gateway", "--bind", "127.0.0.1:0", "--routes",
                              str(routes), "--log-level", "WARNING", "--max-concurrency", str(max(256, concurrency)),
                              "--health-interval", "5"], env)
            gateway_url = _read_line(gateway, r"listening on (http://\S+)/v1", "gateway").group(1)
            asyncio.run(_wait_ready(gateway_url))
            direct, via_gateway = asyncio.run(_measure(upstream_url, gateway_url, concurrency, chunks,
                                                       pace_ms / 1000, per_stream))
    finally:
        if gateway is not None:
            _stop(gateway)
        _stop(upstream)
    base_ttft = percentile([ttft for ttft, _ in direct], 50)
    base_e2e = percentile([e2e for _, e2e in direct], 50)
    added_e2e = [e2e - base_e2e for _, e2e in via_gateway]
    added_ttft = [ttft - base_ttft for ttft, _ in via_gateway]
    return {
        "gateway_overhead_p50_ms": percentile(added_e2e, 50) * 1000,
        "gateway_overhead_p99_ms": percentile(added_e2e, 99) * 1000,
        "gateway_ttft_overhead_p50_ms": percentile(added_ttft, 50) * 1000,
        "gateway_ttft_overhead_p99_ms": percentile(added_ttft, 99) * 1000,
        "direct_residual_p50_ms": base_e2e * 1000,
        "direct_residual_p99_ms": percentile([e2e for _, e2e in direct], 99) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=200, help="streaming requests in flight")
    parser.add_argument("--chunks", type=int, default=64, help="chunks per stream")
    parser.add_argument("--pace-ms", type=float, default=20.0, help="upstream time between chunks")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="measured requests each concurrent stream sends (after one warm-up request)")
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (1 <= args.concurrency <= 5000 and 1 <= args.chunks <= 10000 and 0 < args.pace_ms <= 1000
            and 1 <= args.requests_per_stream <= 100):
        parser.error("need 1-5000 concurrent streams, 1-10000 chunks, 0-1000 ms pace, 1-100 requests per stream")
    if args.serve_upstream:
        asyncio.run(_serve_upstream(args.chunks, args.pace_ms / 1000))
        return 0
    started = time.monotonic()
    figures = run_benchmark(args.concurrency, args.chunks, args.pace_ms, args.requests_per_stream)
    print(f"# {args.concurrency} concurrent streams x {args.requests_per_stream} measured requests, {args.chunks} "
          f"chunks every {args.pace_ms:g} ms; direct client-side residual p50 {figures['direct_residual_p50_ms']:.2f} "
          f"ms, p99 {figures['direct_residual_p99_ms']:.2f} ms; {time.monotonic() - started:.1f} s; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name in ("gateway_overhead_p50_ms", "gateway_overhead_p99_ms", "gateway_ttft_overhead_p50_ms",
                 "gateway_ttft_overhead_p99_ms"):
        print(f"BENCH {name}={figures[name]:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
