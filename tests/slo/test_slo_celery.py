"""The Celery setup: one beat schedule, explicit task names and queues namespaced per deployment, the chdb guard,
and (server mode) the platform's worker and beat on the real Redis broker."""
from __future__ import annotations

import os
import time

import pytest


def test_one_beat_schedule_with_explicit_tasks_and_queues(settings):
    from observatory.celery_app import app, beat_schedule, queue_name

    settings.CELERY_QUEUE_PREFIX = "acme."
    schedule = beat_schedule()
    assert {name: (entry["task"], entry["schedule"], entry["options"]["queue"]) for name, entry in schedule.items()} == {
        "slo-evaluate-all": ("slo.evaluate_all", 5.0, "acme.slo"),
        "alerts-detect-regressions": ("alerts.detect_regressions", 60.0, "acme.alerts"),
        "alerts-check-repeats": ("alerts.check_repeats", 60.0, "acme.alerts"),
        "notify-deliver-due": ("notify.deliver_due", 10.0, "acme.notify"),
        "notify-prune-deliveries": ("notify.prune_deliveries", 3600.0, "acme.notify"),
        "regressions-sweep": ("regressions.sweep", 15.0, "acme.regressions"),
        "tuning-sweep": ("tuning.sweep", 15.0, "acme.tuning"),
        "tuning-calibrate-groups": ("tuning.calibrate_groups", 300.0, "acme.tuning"),
        "rollouts-sweep": ("rollouts.sweep", 5.0, "acme.rollouts"),
        "loops-sweep": ("loops.sweep", 10.0, "acme.loops"),
    }
    assert queue_name("slo") == "acme.slo"
    app.loader.import_default_modules()
    assert "slo.evaluate_all" in app.tasks and "regressions.execute" in app.tasks and "tuning.execute" in app.tasks
    assert "rollouts.advance" in app.tasks and "rollouts.sweep" in app.tasks
    assert "tuning.calibrate" in app.tasks and "tuning.calibrate_groups" in app.tasks
    assert "loops.advance" in app.tasks and "loops.sweep" in app.tasks


def test_queues_are_namespaced_by_database_on_a_shared_broker():
    from observatory.celery_app import namespace

    postgres = {"ENGINE": "django.db.backends.postgresql", "NAME": "observatory_prod"}
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/data/observatory.sqlite3"}
    # the filesystem broker lives in the data directory: nothing to share
    assert namespace(None, "filesystem://", postgres) == ""
    assert namespace(None, "redis://127.0.0.1:6379/0", postgres) == "observatory_prod."
    assert namespace(None, "amqp://rabbit//", {**postgres, "NAME": "a b"}) == "a_b."
    prefix = namespace(None, "redis://127.0.0.1:6379/0", sqlite)
    assert prefix.startswith("obs-") and prefix.endswith(".") and prefix != namespace(
        None, "redis://127.0.0.1:6379/0", {**sqlite, "NAME": "/other/observatory.sqlite3"})
    assert namespace("", "redis://127.0.0.1:6379/0", postgres) == ""
    assert namespace("team-a.", "redis://127.0.0.1:6379/0", postgres) == "team-a."


def test_evaluation_refuses_to_open_chdb_outside_the_platform_process(settings, caplog):
    """A stray `celery worker` next to an embedded platform must not open (and lock) the chdb directory."""
    from slo.tasks import evaluate_all_task

    settings.EMBEDDED_MODE = True
    assert evaluate_all_task.run() == 0
    assert "slo.evaluate_all skipped: ClickHouse is chdb and this process is not the platform" in caplog.text


server_mode = pytest.mark.skipif(
    not os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://"))
    or not os.environ.get("CELERY_BROKER_URL", "").startswith("redis://"),
    reason="server mode only (DATABASE_URL=postgresql://…, CELERY_BROKER_URL=redis://…)",
)


@pytest.mark.server_mode
@server_mode
def test_platform_worker_and_beat_run_on_redis(fresh_platform_factory, tmp_path):
    from urllib.parse import urlparse

    import redis

    platform = fresh_platform_factory(extra_env={"SLO_EVALUATE_INTERVAL_SECONDS": "1"}, grpc=False)
    database = urlparse(platform.process.env["DATABASE_URL"]).path.lstrip("/")
    client = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    path = str(tmp_path / "slos.yaml")
    with open(path, "w") as f:
        f.write("project: alpha\nslos:\n  - {name: errors, sli: error_ratio, objective: 99%}\n")
    platform.process.manage("slo", "apply", path)
    deadline = time.time() + 30
    body = None
    while time.time() < deadline:
        status, body = platform.process.get("/api/v1/slos/errors", platform.tokens["alice"])
        if status == 200 and body["status"]["last_evaluated_at"]:
            break
        time.sleep(0.25)
    assert body and body["status"]["last_evaluated_at"], body
    assert body["status"]["state"] == "no_data"
    # the platform's queues live in Redis under the database's namespace
    bindings = {key.decode() for key in client.scan_iter(match=f"_kombu.binding.{database}.*")}
    assert {f"_kombu.binding.{database}.slo", f"_kombu.binding.{database}.notify"} <= bindings
