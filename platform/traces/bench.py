"""`latency/summary` grouped by model and prompt bucket over 10 million request rows, through the HTTP API.

    python -m traces.bench [--rows 10000000] [--days 7] [--runs 15]

Rows are generated inside ClickHouse (INSERT … SELECT from numbers()) over the last
`days` days, hour touches recorded, and the platform's own rollup builder run once,
exactly as the running platform would; then a real platform process answers the
API calls and the median over `runs` calls is printed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time

from benchkit.harness import PlatformProcess
from benchkit.timing import p90, timed

from traces import rollups
from traces.seed import platform_store, seed_requests


def seed(data_dir: str, project_name: str, rows: int, days: int) -> None:
    with platform_store(data_dir, project_name) as (store, project_id):
        end = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
        started = time.perf_counter()
        seed_requests(store, project_id, rows=rows, start=end - dt.timedelta(days=days), end=end)
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


def rows_arguments(argv=None) -> argparse.Namespace:
    """--rows, --days and --runs of the benchmarks over generated request rows (this one, dashboards.bench)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--runs", type=int, default=15)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = rows_arguments(argv)
    platform = PlatformProcess()
    _, token = platform.setup()
    seed(platform.data_dir, "bench", args.rows, args.days)
    platform.start()
    try:
        since = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=args.days + 1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        path = f"/api/v1/latency/summary?group_by=model,prompt_bucket&since={since}"

        def summary() -> dict:
            status, body = platform.get(path, token)
            if status != 200:
                raise SystemExit(f"summary failed: {status} {body}")
            return body

        timings, body = timed(summary, args.runs)
        total = sum(g["count"] for g in body["groups"])
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
    print(f"BENCH summary_10m_rows_p90_ms={p90(timings) * 1000:.1f} ms")
    print(f"BENCH summary_exact_raw_scan_ms={exact_ms:.1f} ms")


if __name__ == "__main__":
    main()
