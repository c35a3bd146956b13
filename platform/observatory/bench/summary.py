"""`latency/summary` grouped by model and prompt bucket over 10 million request rows, through the HTTP API.

    python -m observatory.bench.summary [--rows 10000000] [--days 7] [--runs 15]

Rows are generated inside ClickHouse (INSERT … SELECT from numbers()) over the last
`days` days, hour touches recorded, and the platform's own rollup builder run once,
exactly as the running platform would; then a real platform process answers the
API calls and the median over `runs` calls is printed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

from .harness import PlatformProcess


def seed(data_dir: str, project_name: str, rows: int, days: int) -> None:
    os.environ["OBSERVATORY_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")
    import django

    django.setup()
    from tenancy.models import Project
    from traces import ch_migrate, rollups
    from traces.store import get_store, reset_store

    project_id = Project.objects.get(name=project_name).id
    store = get_store()
    ch_migrate.apply(store, log=lambda *_: None)
    end = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = end - dt.timedelta(days=days)
    step_us = int(days * 86400 * 1e6 / rows)
    version = time.time_ns()
    started = time.perf_counter()
    store.tenant_command(
        f"INSERT INTO {store.table('llm_requests')} (project_id, trace_id, request_key, request_id, start_time, "
        "service, model, engine_config, prompt_tokens, completion_tokens, prompt_bucket, e2e_ms, ttft_ms, "
        "engine_ttft_ms, tpot_ms, network_ms, overhead_ms, queue_ms, prefill_ms, decode_ms, hops, status, version, "
        "is_deleted, retention_days) "
        "SELECT {project_id:UInt32}, lower(hex(sipHash128(number))), lower(hex(sipHash64(number))), '', "
        "fromUnixTimestamp64Micro(toInt64({start_us:Int64} + number * {step_us:Int64})), "
        "['chat-app', 'agent', 'batch'][number % 3 + 1], "
        "['meta-llama/Llama-3.1-8B-Instruct', 'meta-llama/Llama-3.1-70B-Instruct', 'Qwen/Qwen2.5-32B-Instruct'][number % 7 % 3 + 1], "
        "['baseline', 'canary'][number % 10 = 0 ? 2 : 1], "
        "toUInt32(p), toUInt32(c), multiIf(p < 256, '<256', p < 1024, '<1k', p < 4096, '<4k', p < 16384, '<16k', '>=16k'), "
        "net + ovh + q + pre + dec, net + ovh / 2 + q + pre, q + pre, dec / greatest(c - 1, 1), "
        "net, ovh, q, pre, dec, '[]', if(number % 97 = 0, 'error', 'ok'), {version:UInt64}, 0, 30 "
        "FROM (SELECT number, 50 + sipHash64(number, 1) % 8000 AS p, 16 + sipHash64(number, 2) % 600 AS c, "
        "      1 + sipHash64(number, 3) % 2000 / 100 AS net, 2 + sipHash64(number, 4) % 1000 / 100 AS ovh, "
        "      sipHash64(number, 5) % 20000 / 100 AS q, p / 40 AS pre, c * (8 + sipHash64(number, 6) % 2000 / 100) AS dec "
        "      FROM numbers({rows:UInt64}))",
        project_id=project_id,
        parameters={"start_us": int(start.timestamp() * 1e6), "step_us": step_us, "rows": rows, "version": version},
    )
    hours = {int((start + dt.timedelta(hours=h)).timestamp()) for h in range(days * 24)}
    rollups.record_touches(store, project_id, hours, version)
    seeded = time.perf_counter() - started
    started = time.perf_counter()
    built = 0
    while True:
        n = rollups.build_dirty_hours(store, project_id, settle_seconds=0)
        built += n
        if n == 0:
            break
    print(f"seeded {rows} rows in {seeded:.1f}s; built {built} hourly rollups in {time.perf_counter() - started:.1f}s",
          file=sys.stderr)
    reset_store()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)

    platform = PlatformProcess()
    _, token = platform.setup()
    seed(platform.data_dir, "bench", args.rows, args.days)
    platform.start()
    try:
        since = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=args.days + 1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        path = f"/api/v1/latency/summary?group_by=model,prompt_bucket&since={since}"
        timings = []
        total = None
        for i in range(args.runs + 1):
            started = time.perf_counter()
            status, body = platform.get(path, token)
            elapsed = time.perf_counter() - started
            if status != 200:
                raise SystemExit(f"summary failed: {status} {body}")
            total = sum(g["count"] for g in body["groups"])
            if i:  # the first call warms caches
                timings.append(elapsed)
        if total != args.rows:
            raise SystemExit(f"summary counted {total} requests, expected {args.rows}")
        exact_started = time.perf_counter()
        platform.get(path + "&exact=1", token)
        exact_ms = (time.perf_counter() - exact_started) * 1000
    finally:
        platform.stop()
    print(f"BENCH summary_rows={args.rows} rows")
    print(f"BENCH summary_groups={len(body['groups'])} groups")
    print(f"BENCH summary_10m_rows_median_ms={statistics.median(timings) * 1000:.1f} ms")
    print(f"BENCH summary_10m_rows_p90_ms={sorted(timings)[int(len(timings) * 0.9) - 1] * 1000:.1f} ms")
    print(f"BENCH summary_exact_raw_scan_ms={exact_ms:.1f} ms")


if __name__ == "__main__":
    main()
