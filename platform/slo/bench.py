"""One SLO evaluation cycle for 100 SLOs over 10 million request rows.

    python -m slo.bench [--rows 10000000] [--days 30] [--slos 100] [--model-error-slos 5] [--runs 7]

In a scratch data directory (embedded mode: SQLite + chdb in this process): 100 SLOs of mixed SLIs and
filters, the last `model-error-slos` of them on engine_model_error (one per replica group, over a live check of
each group's engine model every 5 minutes for the `days`), request rows generated inside ClickHouse (INSERT …
SELECT from numbers(), as traces.bench does) over the last `days` days with their hour touches, one warm-up cycle
(which builds the SLI buckets of every closed hour, printed as slo_bucket_backfill_s), then `runs`
timed cycles of `evaluate_all` (bucket refresh, window counts, burn rates, status series, SLO rows and
the alert lifecycle when present); the median is the figure.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time

SERVICES = ("chat-app", "agent", "batch")
MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen2.5-32B-Instruct")
BUCKETS = ("<256", "<1k", "<4k", "<16k", ">=16k")
CHECK_INTERVAL = dt.timedelta(minutes=5)  # TUNING_CALIBRATION_CHECK_SECONDS' default


def slo_definitions(count: int) -> list[dict]:
    """Mixed SLIs, thresholds and filters; every definition counts something different."""
    slis = (("ttft_ms", (200, 300, 500, 800)), ("tpot_ms", (20, 30, 40, 60)), ("e2e_ms", (2000, 4000, 8000, 15000)),
            ("queue_ms", (50, 100, 150, 190)), ("error_ratio", (None,)))
    out = []
    for i in range(count):
        sli, thresholds = slis[i % len(slis)]
        filters: dict = {}
        if i % 3 == 0:
            filters["service"] = SERVICES[i % len(SERVICES)]
        if i % 4 == 1:
            filters["model"] = [MODELS[i % len(MODELS)], MODELS[(i + 1) % len(MODELS)]]
        if i % 7 == 2:
            filters["prompt_bucket"] = list(BUCKETS[: 2 + i % 3])
        if i % 10 == 5:
            filters["engine_config"] = "canary"
        definition = {
            "name": f"slo-{i:03d}-{sli.replace('_', '-')}",
            "sli": sli,
            "objective": ("99%", "99.5%", "99.9%", "95%")[i % 4],
            "period": "30d" if i % 2 else "28d",
            "filters": filters,
        }
        if definition["objective"] == "95%":
            # 14.4 × 5% > 100%: the fast page tier cannot fire for a 95% SLO, so it gets its own tiers.
            definition["tiers"] = [
                {"name": "page-6h", "severity": "page", "long_window": "6h", "short_window": "30m", "factor": 6},
                {"name": "ticket-3d", "severity": "ticket", "long_window": "3d", "short_window": "6h", "factor": 1},
            ]
        if thresholds[0] is not None:
            definition["threshold_ms"] = thresholds[(i // len(slis)) % len(thresholds)] + i // 20
        out.append(definition)
    return out


def model_error_definitions(count: int, first: int) -> list[dict]:
    """SLOs on engine_model_error, one per replica group (group-0, group-1, ...)."""
    return [{"name": f"slo-{first + i:03d}-engine-model-error", "sli": "engine_model_error",
             "threshold": (0.1, 0.15, 0.2, 0.25)[i % 4], "objective": ("99%", "99.5%")[i % 2],
             "period": "30d" if i % 2 else "28d", "filters": {"replica_group": f"group-{i}"}, "min_requests": 10}
            for i in range(count)]


def model_checks(groups: int, start: dt.datetime, end: dt.datetime) -> list[dict]:
    """A live check of each group's engine model every CHECK_INTERVAL in [start, end); every 13th misses by 30%."""
    out = []
    at, n = start, 0
    while at < end:
        for g in range(groups):
            error = -0.3 if n % 13 == 0 else 0.05
            out.append({"at": at, "group": f"group-{g}", "model_id": g + 1, "config_version": "bench",
                        "worst_error": abs(error), "ttft_p50_error": 0.02, "prefill_p50_error": 0.02,
                        "tpot_p50_error": error, "requests": 200,
                        "moved": {"decode": -error, "prefill": 0.01}})
            n += 1
        at += CHECK_INTERVAL
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--slos", type=int, default=100)
    parser.add_argument("--model-error-slos", type=int, default=5,
                        help="how many of the SLOs are on engine_model_error (counted from model checks)")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    if not 0 <= args.model_error_slos <= args.slos:
        parser.error("--model-error-slos: between 0 and --slos")

    scratch = tempfile.TemporaryDirectory(prefix="observatory-slo-bench-")
    os.environ["OBSERVATORY_DATA_DIR"] = scratch.name
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("CLICKHOUSE_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command
    from tenancy.models import Project
    from traces import ch_migrate
    from traces.seed import seed_requests
    from traces.store import get_store, reset_store

    from slo import evaluation, queries, services

    call_command("migrate", verbosity=0)
    project = Project.objects.create(name="bench")
    requests_slos = args.slos - args.model_error_slos
    for definition in slo_definitions(requests_slos) + model_error_definitions(args.model_error_slos, requests_slos):
        services.create(project.id, definition)
    store = get_store()
    ch_migrate.apply(store, log=lambda *_: None)
    now = dt.datetime.now(dt.timezone.utc)
    started = time.perf_counter()
    seed_requests(store, project.id, rows=args.rows, start=now - dt.timedelta(days=args.days), end=now,
                  retention_days=args.days + 5, ttft_missing_every=5)
    checks = model_checks(args.model_error_slos, now - dt.timedelta(days=args.days), now)
    queries.insert_model_checks(store, project.id, checks)
    print(f"seeded {args.rows} rows and {len(checks)} model checks over {args.days} days in "
          f"{time.perf_counter() - started:.1f}s", file=sys.stderr)

    started = time.perf_counter()
    evaluated = evaluation.evaluate_all(now)
    backfill = time.perf_counter() - started
    if evaluated != args.slos:
        raise SystemExit(f"evaluated {evaluated} SLOs, expected {args.slos}")
    timings = []
    for _ in range(args.runs):
        started = time.perf_counter()
        evaluation.evaluate_all(now)
        timings.append(time.perf_counter() - started)
    states: dict[str, int] = {}
    from slo.models import SLO

    for state in SLO.objects.values_list("last_state", flat=True):
        states[state] = states.get(state, 0) + 1
    print(f"states after the cycle: {states}", file=sys.stderr)
    reset_store()
    scratch.cleanup()
    print(f"BENCH slo_eval_slos={args.slos} slos")
    print(f"BENCH slo_eval_rows={args.rows} rows")
    print(f"BENCH slo_eval_model_error_slos={args.model_error_slos} slos")
    print(f"BENCH slo_eval_model_checks={len(checks)} checks")
    print(f"BENCH slo_bucket_backfill_s={backfill:.1f} s")
    print(f"BENCH slo_eval_cycle_100_slos_10m_rows_ms={statistics.median(timings) * 1000:.1f} ms")
    print(f"BENCH slo_eval_cycle_max_ms={max(timings) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
