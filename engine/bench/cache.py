"""Benchmark of the gateway's response cache: what a miss costs, what a hit takes, how fast the semantic index is.

    python -m engine.bench.cache [--requests 2000] [--entries 100000] [--dimension 384] [--store redis://…]

Four processes for the first two figures, as in production: an upstream answering at once
(the gateway benchmark's stand-in, ``python -m engine.bench.gateway --serve-upstream``),
a gateway with no cache, a gateway whose group has the exact cache on, and this client,
which sends non-streamed greedy chat requests one at a time:

    BENCH cache_miss_overhead_p50_ms=… ms   p50 latency of a miss through the cached gateway minus
                                           the p50 through the uncached one (every prompt new, so
                                           each request is looked up, forwarded and its answer stored)
    BENCH cache_exact_hit_p50_ms=… ms       p50 latency of an exact hit, client send to last byte
    BENCH cache_exact_hit_p99_ms=… ms

``--store redis://host:port/db`` keeps the cached gateway's entries in Redis instead of its memory (a key prefix of
the run's own, deleted as the entries expire): the two stores measured alike. The requests alternate between the two gateways, so drift in the machine's speed touches both
alike. The third figure is in this process: ``--entries`` stored query vectors of one namespace
and model (the worst case: one partition holds them all), a lookup being the matrix-vector
product, the context and expiry masks and the best row:

    BENCH cache_semantic_lookup_p50_ms=… ms  (embedding call excluded)
    BENCH cache_semantic_lookup_p99_ms=… ms
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np

from engine.bench.gateway import MODEL, _read_line, _start, _stop, _wait_ready, percentile
from engine.gateway.semantic import VectorIndex


async def _latency(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 8}
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
    return time.perf_counter() - started


async def _measure(off_url: str, on_url: str, requests: int) -> dict[str, list[float]]:
    run = uuid.uuid4().hex[:8]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as off, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as on:
        for index in range(200):  # warm-up: connections, code paths
            await _latency(off, off_url, f"warm {run} {index}")
            await _latency(on, on_url, f"warm {run} {index}")
        misses_off, misses_on = [], []
        for index in range(requests):
            misses_off.append(await _latency(off, off_url, f"question {run} {index}"))
            misses_on.append(await _latency(on, on_url, f"question {run} {index}"))
        await _latency(on, on_url, f"repeated {run}")
        await asyncio.sleep(0.2)  # the answer is stored after the client has it
        hits = [await _latency(on, on_url, f"repeated {run}") for _ in range(requests)]
    return {"off": misses_off, "on": misses_on, "hits": hits}


def run_gateways(requests: int, store: str = "memory") -> dict[str, list[float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    upstream = _start([sys.executable, "-m", "engine.bench.gateway", "--serve-upstream", "--chunks", "1",
                       "--pace-ms", "0.001"], env)
    gateways = []
    try:
        port = int(_read_line(upstream, r"^PORT (\d+)", "upstream").group(1))
        upstream_url = f"http://127.0.0.1:{port}"
        urls = []
        with tempfile.TemporaryDirectory() as folder:
            cached = {"exact": {"enabled": True, "max_entries": 4 * requests, "ttl_s": 600}, "store": store}
            if store != "memory":
                cached["key_prefix"] = f"bench-{uuid.uuid4().hex[:8]}:"
            for name, cache in (("off", None), ("on", cached)):
                routes = Path(folder) / f"{name}.json"
                group = {"name": "bench", "weight": 1, "upstreams": [upstream_url], "cache": cache}
                routes.write_text(json.dumps([group]))
                process = _start([sys.executable, "-m", "engine.gateway", "--bind", "127.0.0.1:0", "--routes",
                                  str(routes), "--log-level", "WARNING", "--health-interval", "5"], env)
                gateways.append(process)
                urls.append(_read_line(process, r"listening on (http://\S+)/v1", f"gateway ({name})").group(1))
            for url in urls:
                asyncio.run(_wait_ready(url))
            return asyncio.run(_measure(urls[0], urls[1], requests))
    finally:
        for process in gateways:
            _stop(process)
        _stop(upstream)


def semantic_lookups(entries: int, dimension: int, lookups: int = 200) -> list[float]:
    """Seconds per lookup in an index of ``entries`` vectors of one partition (a third of another context)."""
    rng = np.random.default_rng(40)
    vectors = rng.standard_normal((entries, dimension), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(entries)
    expires = time.time() + 3600
    for number, vector in enumerate(vectors):
        index.add("namespace\0model", str(number), number % 3, vector, expires, 0.0)
    times = []
    for number in range(lookups):
        query = vectors[(number * 7919) % entries] + rng.standard_normal(dimension, dtype=np.float32) * 0.01
        query /= np.linalg.norm(query)
        started = time.perf_counter()
        index.search("namespace\0model", 0, query, time.time(), 0.9)
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="misses per gateway, and hits")
    parser.add_argument("--entries", type=int, default=100_000, help="vectors in the semantic index")
    parser.add_argument("--dimension", type=int, default=384, help="their dimension")
    parser.add_argument("--store", default="memory", help="the cached gateway's store: memory or redis://host:port/db")
    args = parser.parse_args(argv)
    if not (10 <= args.requests <= 100_000 and 1 <= args.entries <= 1_000_000 and 1 <= args.dimension <= 8192):
        parser.error("need 10-100000 requests, 1-1000000 entries, dimension 1-8192")
    started = time.monotonic()
    lookups = semantic_lookups(args.entries, args.dimension)
    samples = run_gateways(args.requests, args.store)
    ms = {name: [value * 1000 for value in values] for name, values in samples.items()}
    print(f"# {args.requests} misses through each gateway, alternating, then {args.requests} hits; miss p50 "
          f"{percentile(ms['off'], 50):.3f} ms without the cache, {percentile(ms['on'], 50):.3f} ms with it; "
          f"store {args.store}; semantic index of {args.entries} x {args.dimension}; {time.monotonic() - started:.1f} s; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"BENCH cache_miss_overhead_p50_ms={percentile(ms['on'], 50) - percentile(ms['off'], 50):.3f} ms")
    print(f"BENCH cache_exact_hit_p50_ms={percentile(ms['hits'], 50):.3f} ms")
    print(f"BENCH cache_exact_hit_p99_ms={percentile(ms['hits'], 99):.3f} ms")
    print(f"BENCH cache_semantic_lookup_p50_ms={percentile(lookups, 50) * 1000:.3f} ms")
    print(f"BENCH cache_semantic_lookup_p99_ms={percentile(lookups, 99) * 1000:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
