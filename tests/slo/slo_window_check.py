"""Run as a script (its own process: chdb opens one data directory per process): window counts computed from
buckets + raw rows must equal a brute-force count over the rows, whatever is built, dirty or rebuilt, for windows
ending on a whole minute and 17 seconds into one (the page tiers are evaluated every few seconds). Some rows are
the gateway's response-cache hits (fast, served_from exact_cache | semantic_cache): only the SLIs that include cached
traffic count them; the others are written as rows were before the column existed (served_from read as 'engine').

    python tests/slo/slo_window_check.py   → prints one "OK <phase>" line per phase, exits 1 on a mismatch
"""
from __future__ import annotations

import datetime as dt
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]
UTC = dt.timezone.utc
COLUMNS = (
    "project_id", "trace_id", "request_key", "request_id", "start_time", "service", "model", "engine_config",
    "prompt_tokens", "completion_tokens", "prompt_bucket", "e2e_ms", "ttft_ms", "engine_ttft_ms", "tpot_ms",
    "network_ms", "network_client_gateway_ms", "network_gateway_engine_ms", "overhead_ms", "queue_ms",
    "prefill_ms", "decode_ms", "hops", "status", "version", "is_deleted", "retention_days", "replica_group",
)


def main() -> int:
    scratch = tempfile.TemporaryDirectory(prefix="slo-window-check-")
    os.environ["OBSERVATORY_DATA_DIR"] = scratch.name
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("CLICKHOUSE_URL", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "observatory.settings"
    import django

    django.setup()
    import orjson
    from slo import queries
    from slo.burn import WindowCounts
    from slo.evaluation import refresh_buckets
    from traces import ch_migrate, rollups
    from traces.store import ClickHouseStore

    store = ClickHouseStore(url=None, chdb_path=f"{scratch.name}/chdb", database="observatory")
    ch_migrate.apply(store, log=lambda *_: None)
    project, other = 7, 8
    now = dt.datetime.now(UTC).replace(second=0, microsecond=0) + dt.timedelta(seconds=17)
    ats = (now.replace(second=0), now)
    rng = random.Random(4)
    rows = []
    for i in range(40_000):
        start = now - dt.timedelta(days=4) + dt.timedelta(seconds=rng.uniform(0, 4 * 86400 + 300))
        ttft = rng.choice([None, rng.uniform(0, 1000)])
        rows.append({
            "project_id": project if i % 10 else other, "trace_id": f"{i:032x}", "request_key": f"{i:016x}",
            "request_id": "", "start_time": start, "service": rng.choice(["a", "b", "c"]),
            "model": rng.choice(["m1", "m2"]), "engine_config": rng.choice(["", "canary"]), "prompt_tokens": None,
            "completion_tokens": None, "prompt_bucket": rng.choice(["<256", "<1k", "<4k"]),
            "e2e_ms": rng.uniform(0, 5000), "ttft_ms": ttft,
            "engine_ttft_ms": None if rng.random() < 0.5 else rng.uniform(0, 1000),
            "tpot_ms": rng.choice([None, rng.uniform(0, 80)]), "network_ms": None, "network_client_gateway_ms": None,
            "network_gateway_engine_ms": None, "overhead_ms": None, "queue_ms": rng.choice([None, rng.uniform(0, 300)]),
            "prefill_ms": None, "decode_ms": None, "hops": "[]", "status": "error" if rng.random() < 0.05 else "ok",
            "version": 1, "is_deleted": 0, "retention_days": 30, "replica_group": rng.choice(["", "blue", "green"]),
            "served_from": "engine",
        })
        if rng.random() < 0.15:  # a response-cache hit: milliseconds, no engine figures
            hit = rng.uniform(0.5, 20)
            rows[-1].update(served_from=rng.choice(["exact_cache", "semantic_cache"]), e2e_ms=hit, ttft_ms=hit,
                            engine_ttft_ms=None, tpot_ms=0.0, queue_ms=0.0, status="ok")

    def insert(batch, version):
        for row in batch:
            row["version"] = version
        for columns, part in ((COLUMNS, [r for r in batch if r["served_from"] == "engine"]),
                              ((*COLUMNS, "served_from"), [r for r in batch if r["served_from"] != "engine"])):
            lines = b"\n".join(orjson.dumps([r[c].strftime("%Y-%m-%d %H:%M:%S.%f") if c == "start_time" else r[c]
                                             for c in columns]) for r in part)
            store.insert_encoded("llm_requests", columns, lines, "JSONCompactEachRow")
        for pid in (project, other):
            hours = {int(r["start_time"].timestamp()) // 3600 * 3600 for r in batch if r["project_id"] == pid}
            rollups.record_touches(store, pid, hours, version)

    insert(rows, 1)
    definitions = [
        queries.SliDefinition(11, "ttft_ms", 500.0, ()),
        queries.SliDefinition(12, "e2e_ms", 2500.0, (("service", ("a", "b")),)),
        queries.SliDefinition(13, "error_ratio", None, (("engine_config", ("canary",)), ("service", ("c",)))),
        queries.SliDefinition(14, "tpot_ms", 40.0, (("model", ("m2",)), ("prompt_bucket", ("<1k", "<4k")))),
        queries.SliDefinition(15, "queue_ms", 150.0, ()),
        queries.SliDefinition(16, "ttft_ms", 300.0, (("replica_group", ("green",)),)),
        queries.SliDefinition(17, "ttft_ms", 500.0, (), True),
        queries.SliDefinition(18, "error_ratio", None, (("service", ("a",)),), True),
    ]
    windows = [dt.timedelta(minutes=m) for m in (5, 30, 37, 60, 93, 120, 360, 1440, 4320)]

    def value(row, sli):
        if sli == "ttft_ms":
            return row["ttft_ms"] if row["ttft_ms"] is not None else row["engine_ttft_ms"]
        return row[sli]

    def brute():
        return {at: brute_at(at) for at in ats}

    def brute_at(at):
        current = {}
        for r in rows:  # the newest version of each row, as FINAL reads it
            current[r["trace_id"]] = r
        out = {}
        for d in definitions:
            for w in windows:
                total = bad = 0
                for r in current.values():
                    if r["project_id"] != project or not (at - w <= r["start_time"] < at):
                        continue
                    if any(r[col] not in allowed for col, allowed in d.filters):
                        continue
                    if r["served_from"] != "engine" and not d.include_cached:
                        continue
                    if d.sli == "error_ratio":
                        total += 1
                        bad += r["status"] == "error"
                    elif value(r, d.sli) is not None:
                        total += 1
                        bad += value(r, d.sli) > d.threshold_ms
                out[(d.key, w)] = WindowCounts(total, bad)
        return out

    settled = now - dt.timedelta(minutes=2)
    open_from = settled.replace(minute=0, second=0, microsecond=0)
    since = (ats[0] - max(windows)).replace(minute=0, second=0, microsecond=0)

    def counted(dirty):
        return {at: queries.window_counts(store, project, definitions, windows, at, open_from=open_from, dirty=dirty)
                for at in ats}

    def matches(got, expected):
        return got == {at: {d.key: {w: expected[at][(d.key, w)] for w in windows} for d in definitions} for at in ats}

    def check(phase, expected, budget):
        remaining = refresh_buckets(store, project, definitions, since=since, settled=settled, budget_seconds=budget)
        got = counted({(k, h) for k, h, _ in remaining})
        wrong = [(at.time(), d.key, w, got[at][d.key][w], expected[at][(d.key, w)]) for at in ats
                 for d in definitions for w in windows if got[at][d.key][w] != expected[at][(d.key, w)]]
        if wrong:
            print(f"FAIL {phase}: {wrong[:5]}")
            return False
        print(f"OK {phase} ({len(remaining)} dirty (SLI, hour) pairs left)")
        return True

    expected = brute()
    dirty = queries.dirty_hours(store, project, [d.key for d in definitions], since, settled)
    ok = matches(counted({(k, h) for k, h, _ in dirty}), expected)
    print(f"{'OK' if ok else 'FAIL'} nothing built, all from raw rows ({len(dirty)} dirty)")
    ok &= check("one batch built", expected, budget=0)
    ok &= check("all built", expected, budget=60)
    # late spans change rows of a closed hour (newer version): counts follow before and after the rebuild
    hour = (now - dt.timedelta(hours=5)).replace(minute=0, second=0, microsecond=0)
    late = [dict(r) for r in rows if hour <= r["start_time"] < hour + dt.timedelta(hours=1)]
    for r in late:
        r["status"], r["e2e_ms"], r["ttft_ms"] = "error", 9999.0, 9999.0
    insert(late, 2)
    rows.extend(late)
    expected = brute()
    dirty = queries.dirty_hours(store, project, [d.key for d in definitions], since, settled)
    late_ok = matches(counted({(k, h) for k, h, _ in dirty}), expected)
    print(f"{'OK' if late_ok else 'FAIL'} late data, not rebuilt yet ({sorted({h for _, h, _ in dirty})})")
    ok &= late_ok
    ok &= check("late data, rebuilt", expected, budget=60)
    store.close()
    scratch.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
