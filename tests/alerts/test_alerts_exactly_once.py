"""Two workers and a doubled beat produce exactly one notification per transition (server mode: PostgreSQL and a
real Redis broker).

Two `runplatform` processes share one PostgreSQL database and one broker; each runs its own Celery worker (a
thread pool) and its own beat, so every evaluation tick is scheduled twice and either worker may take either
copy. chdb lets one process open a data directory, so each platform gets its own copy of the same seeded
directory: two evaluators compute the same result from the same rows and race to claim each transition. The
SLO's page tier is short (2 min / 1 min) and the beat ticks every 2 s, so the alert fires at the first
evaluation and resolves one minute after the last bad minute; a real HTTP receiver counts what arrives.
"""
from __future__ import annotations

import collections
import datetime as dt
import json
import shutil
import threading
import time

import pytest
from alerts_support import (
    Receiver,
    create_database,
    drop_database,
    insert_requests,
    open_store,
    scrape_metrics,
    server_mode_urls,
    spread,
    sql,
)
from benchkit.harness import PlatformProcess

pytestmark = pytest.mark.server_mode

SLO_YAML = """
project: alpha
slos:
  - name: chat-ttft
    sli: ttft_ms
    threshold_ms: 200
    objective: 99%
    filters: {service: [chat]}
    tiers:
      - {name: page-fast, severity: page, long_window: 2m, short_window: 1m, factor: 14.4}
"""


def _floor_minute(t: dt.datetime) -> dt.datetime:
    return t.replace(second=0, microsecond=0)


def test_two_workers_and_doubled_beat_send_one_notification_per_transition(tmp_path):
    urls = server_mode_urls()
    if urls is None:
        pytest.skip("server mode only: DATABASE_URL=postgresql://… and CELERY_BROKER_URL=redis://…")
    admin_url, broker = urls
    db_url = create_database(admin_url)
    receiver = Receiver()
    env = {
        "DATABASE_URL": db_url, "CELERY_BROKER_URL": broker, "OBSERVATORY_INPROCESS_WORKER": "true",
        "SLO_EVALUATE_INTERVAL_SECONDS": "2", "ALERTS_PAGE_FOR_SECONDS": "0",
        "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": "127.0.0.1:1024-65535", "LOG_LEVEL": "INFO",
    }
    platforms = [PlatformProcess(data_dir=str(tmp_path / name), extra_env=env) for name in ("one", "two")]
    try:
        first = platforms[0]
        *_, admin = first.manage_many(("migrate", "-v0"), ("create_ingest_key", "--project", "alpha"),
                                      ("create_api_token", "--user", "alice", "--role", "admin", "--project", "alpha"))
        [(project_id,)] = sql(db_url, "SELECT id FROM tenancy_project WHERE name = 'alpha'")

        # Bad TTFT from the minute before now up to the minute boundary before now + 35 s: the platforms start
        # and get their SLO well within 35 s, so whichever minute the first evaluation lands in ends with a bad
        # minute; one minute after the last bad one the burn clears.
        now = dt.datetime.now(dt.timezone.utc)
        bad_since = _floor_minute(now) - dt.timedelta(minutes=1)
        bad_until = _floor_minute(now + dt.timedelta(seconds=35))
        seed_path = tmp_path / "one" / "chdb"
        store, close = open_store(str(seed_path))
        minutes = int((bad_until - bad_since) / dt.timedelta(minutes=1))
        insert_requests(store, spread(project_id, bad_since - dt.timedelta(minutes=2), bad_since, 120,
                                      service="chat", queue=20.0))
        insert_requests(store, spread(project_id, bad_since, bad_until, 60 * minutes, seed=2, service="chat",
                                      queue=900.0))
        close()
        shutil.copytree(seed_path, tmp_path / "two" / "chdb")

        starters = [threading.Thread(target=p.start) for p in platforms]
        for thread in starters:
            thread.start()
        for thread in starters:
            thread.join()
        assert all(p.proc and p.proc.poll() is None for p in platforms), [p.log_tail() for p in platforms]

        status, _, body = first.post("/api/v1/channels?project=alpha", json.dumps({
            "name": "hook", "kind": "webhook", "url": receiver.url}).encode(),
            {"Authorization": f"Bearer {admin}", "Content-Type": "application/json"})
        assert status == 201, body
        slo_file = tmp_path / "slo.yaml"
        slo_file.write_text(SLO_YAML)
        first.manage("slo", "apply", str(slo_file))

        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and len(receiver.bodies()) < 2:
            time.sleep(0.5)
        time.sleep(14)  # more ticks of both beats and one more delivery round: nothing else may arrive
        bodies = receiver.bodies()
        assert [b["status"] for b in bodies] == ["firing", "resolved"], (
            bodies, [p.log_tail() for p in platforms])
        assert len({r["headers"]["webhook-id"] for r in receiver.requests}) == 2
        assert len({b["event_id"] for b in bodies}) == 2 and len({b["fingerprint"] for b in bodies}) == 1
        assert bodies[0]["labels"]["slo"] == "chat-ttft" and bodies[0]["diagnosis"]["dominant_component"] == "queue"

        transitions = sql(db_url, "SELECT from_state, to_state, notified, delivery_ids "
                                  "FROM alerts_alerttransition ORDER BY at, id")
        assert [(f, t, n) for f, t, n, _ in transitions] == [
            ("", "pending", False), ("pending", "firing", True), ("firing", "resolved", True)]
        deliveries = sql(db_url, "SELECT id, status, attempts FROM notify_delivery ORDER BY id")
        assert [(s, a) for _, s, a in deliveries] == [("succeeded", 1), ("succeeded", 1)]
        assert [ids for *_, ids in transitions if ids] == [[d[0]] for d in deliveries]

        # Both workers evaluated (the race was real), each many times within the same minute; each platform's
        # /metrics counts its own evaluation cycles and the transitions it claimed: one of each in all.
        scraped = [scrape_metrics(platform.url) for platform in platforms]
        runs = [s["observatory_slo_evaluations_total"][frozenset()] for s in scraped]
        assert all(r >= 3 for r in runs), runs
        claimed = collections.Counter()
        for samples in scraped:
            for labels, value in samples["observatory_alert_transitions_total"].items():
                if value:
                    claimed[dict(labels)["severity"], dict(labels)["to"]] += value
        assert claimed == {("page", "pending"): 1, ("page", "firing"): 1, ("page", "resolved"): 1}, claimed
    finally:
        for platform in platforms:
            platform.stop()
        receiver.close()
        drop_database(admin_url, db_url)
