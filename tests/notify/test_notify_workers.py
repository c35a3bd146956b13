"""Server mode: two real Celery worker processes on the real broker (Redis) and PostgreSQL, flooded with
notify.deliver_due tasks as a doubled beat would send them, race to claim the same deliveries. Each receiver gets
each delivery exactly once (a flaky one: exactly one successful request per delivery, however many retries)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from notify import services
from notify.models import Channel, Delivery
from notify_receivers import Receiver, Reply
from prometheus_client.parser import text_string_to_metric_families
from tenancy.models import Project

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.server_mode, pytest.mark.skipif(
    not os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://")),
    reason="server mode only: needs DATABASE_URL=postgresql://... and a real broker (CELERY_BROKER_URL)")]
EVENTS = 15


def start_worker(name: str, queue: str, database_url: str, data_dir: Path, metrics_port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "observatory.settings",
        "OBSERVATORY_DATA_DIR": str(data_dir),
        "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": "127.0.0.1:1024-65535",
        "NOTIFY_BACKOFF_BASE_SECONDS": "0.2",
        "NOTIFY_BACKOFF_JITTER": "0",
        "NOTIFY_PER_CHANNEL_BATCH": "3",  # small batches: many claims racing for the same rows
        "OBSERVATORY_WORKER_METRICS_BIND": f"127.0.0.1:{metrics_port}",
    }
    log = open(data_dir / f"{name}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "observatory.celery_app", "worker", "-Q", queue, "--pool", "threads",
         "-c", "2", "-n", f"{name}@localhost", "--without-heartbeat", "--without-mingle", "--without-gossip",
         "-l", "WARNING"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, str, str], float]:
    """{(metric, kind, outcome): value} of a worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, sample.labels.get("kind", ""), sample.labels.get("outcome", "")): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_two_workers_and_a_doubled_beat_deliver_each_exactly_once(transactional_db, tmp_path):
    from django.db import connection
    from observatory.celery_app import app

    settings_dict = connection.settings_dict
    database_url = (f"postgresql://{settings_dict['USER']}:{settings_dict['PASSWORD']}@{settings_dict['HOST']}:"
                    f"{settings_dict['PORT'] or 5432}/{settings_dict['NAME']}")
    queue = f"notify-test-{uuid.uuid4().hex[:8]}"
    project = Project.objects.create(name="workers")
    with Receiver() as healthy, Receiver([Reply(500)] * 6) as flaky:
        Channel.objects.create(project=project, name="healthy", kind="webhook", url=healthy.url)
        Channel.objects.create(project=project, name="flaky", kind="alertmanager", url=flaky.url)
        for n in range(EVENTS):
            services.enqueue(project.id, {"event_id": f"evt-{n}", "fingerprint": f"fp-{n}", "status": "firing",
                                          "labels": {"alertname": "X"}}, severity="page")
        assert Delivery.objects.count() == 2 * EVENTS
        ports = [free_port() for _ in range(2)]
        workers = [start_worker(f"w{i}-{queue}", queue, database_url, tmp_path, ports[i]) for i in range(2)]
        try:
            # Both workers ready (their /metrics is served from worker_ready) before the beats tick: else on a
            # loaded host one worker may deliver everything before the other has started, and the race is not run.
            ready_by = time.time() + 120
            for port in ports:
                while True:
                    assert all(w.poll() is None for w in workers), [p.read_text()[-2000:]
                                                                    for p in tmp_path.glob("*.log")]
                    try:
                        scrape(port)
                        break
                    except OSError:
                        assert time.time() < ready_by, "a worker did not become ready in 120 s"
                        time.sleep(0.2)
            deadline = time.time() + 90
            while time.time() < deadline:
                for _ in range(2):  # two beats ticking at once
                    app.send_task("notify.deliver_due", queue=queue, exchange=queue, routing_key=queue)
                if not Delivery.objects.exclude(status="succeeded").exists():
                    break
                assert all(w.poll() is None for w in workers), [p.read_text()[-2000:]
                                                                for p in tmp_path.glob("*.log")]
                time.sleep(0.3)
            # Each worker serves what it sent on its own /metrics: together, every delivery and attempt.
            scraped = [scrape(port) for port in ports]
        finally:
            for worker in workers:
                stop(worker)
    assert sum(s.get(("observatory_notify_deliveries_total", "webhook", "succeeded"), 0) for s in scraped) == EVENTS
    assert sum(s.get(("observatory_notify_deliveries_total", "alertmanager", "succeeded"), 0)
               for s in scraped) == EVENTS
    assert sum(s.get(("observatory_notify_delivery_attempts_total", "alertmanager", "transient"), 0)
               for s in scraped) == 6
    statuses = Counter(Delivery.objects.values_list("status", flat=True))
    assert statuses == {"succeeded": 2 * EVENTS}, (statuses, [p.read_text()[-2000:] for p in tmp_path.glob("*.log")])
    healthy_ids = Counter(r.headers["webhook-id"] for r in healthy.requests)
    assert len(healthy_ids) == EVENTS and set(healthy_ids.values()) == {1}
    successes = Counter(r.headers["webhook-id"] for r in flaky.requests if r.status == 200)
    assert len(successes) == EVENTS and set(successes.values()) == {1}
    assert len(flaky.requests) == EVENTS + 6
    assert sum(Delivery.objects.filter(channel__name="flaky").values_list("attempts", flat=True)) == EVENTS + 6
