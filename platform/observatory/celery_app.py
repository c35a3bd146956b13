"""The Celery application: broker from settings (Redis/RabbitMQ, or the local filesystem when embedded), queues, beat schedule.

Server mode:  celery -A observatory.celery_app worker      (consumes every queue below)
              celery -A observatory.celery_app beat        (one beat; a second one is harmless: work is
                                                            claimed in the database, never in the broker)
Embedded mode, and whenever ClickHouse is chdb: `runplatform` runs a thread-pool worker and the beat
itself (observatory/background.py, OBSERVATORY_INPROCESS_WORKER), because only that process may open chdb.
"""
import hashlib
import logging
import os
import re

from celery import Celery, signals
from django.conf import settings
from kombu import Exchange, Queue
from prometheus_client import start_http_server

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")

log = logging.getLogger(__name__)

app = Celery("observatory")
app.config_from_object("django.conf:settings", namespace="CELERY")

# The apps whose tasks.py this worker loads (explicit: autodiscovery would import every installed app).
TASK_MODULES = ("slo.tasks", "alerts.tasks", "notify.tasks", "regressions.tasks", "tuning.tasks", "rollouts.tasks",
                "loops.tasks")
QUEUES = ("slo", "alerts", "notify", "regressions", "tuning", "rollouts", "loops")


def queue_prefix() -> str:
    """Queues are namespaced so that two deployments (or two test platforms) sharing one broker never take
    each other's tasks, whose work is "everything in my database"."""
    return namespace(getattr(settings, "CELERY_QUEUE_PREFIX", None), settings.CELERY_BROKER_URL,
                     settings.DATABASES["default"])


def namespace(explicit: str | None, broker_url: str, database: dict) -> str:
    """CELERY_QUEUE_PREFIX if set; none with the per-data-directory filesystem broker; else the metadata
    database's name (PostgreSQL) or a hash of its path (SQLite)."""
    if explicit is not None:
        return explicit
    if broker_url.startswith("filesystem://"):
        return ""
    name = str(database.get("NAME") or "")
    if database["ENGINE"].endswith("sqlite3"):
        return f"obs-{hashlib.sha256(name.encode()).hexdigest()[:10]}."
    return re.sub(r"[^A-Za-z0-9_-]", "_", name) + "."


def queue_name(short: str) -> str:
    return f"{queue_prefix()}{short}"


def beat_schedule() -> dict:
    """The one beat schedule: SLO evaluation every 5 s, the regression detector and alert repeats every minute, due
    webhook deliveries every 10 s (a new notification is sent at once: notify.services.enqueue asks for a delivery
    round), pruning of old deliveries every hour."""
    slo = getattr(settings, "SLO", {})
    every = float(slo.get("EVALUATE_INTERVAL_SECONDS", 5.0))
    alerts_every = float(getattr(settings, "ALERTS", {}).get("CHECK_INTERVAL_SECONDS", 60.0))
    notify = getattr(settings, "NOTIFY", {})
    deliver_every = float(notify.get("DELIVER_INTERVAL_SECONDS", 10.0))
    prune_every = float(notify.get("PRUNE_INTERVAL_SECONDS", 3600.0))
    sweep_every = float(getattr(settings, "REGRESSIONS", {}).get("SWEEP_INTERVAL_SECONDS", 15.0))
    tuning_every = float(getattr(settings, "TUNING", {}).get("SWEEP_INTERVAL_SECONDS", 15.0))
    rollouts_every = float(getattr(settings, "ROLLOUTS", {}).get("SWEEP_INTERVAL_SECONDS", 5.0))
    loops_every = float(getattr(settings, "LOOPS", {}).get("SWEEP_INTERVAL_SECONDS", 10.0))
    # Engine models: their error on the latest traffic, and which groups are due for a calibration
    # (CALIBRATION_INTERVAL_SECONDS after their last), every CALIBRATION_CHECK_SECONDS; queued calibrations nobody
    # took are started by the tuning sweep.
    calibrate_every = float(getattr(settings, "TUNING", {}).get("CALIBRATION_CHECK_SECONDS", 300.0))
    # A tick that waited in the broker (worker down or busy) expires: the next one does the same work. Not
    # sooner than 30 s, so that a slow broker poll under load does not discard every short-interval tick.
    def options(queue: str, interval: float) -> dict:
        return {"queue": queue_name(queue), "expires": max(interval, 30.0)}

    return {
        "slo-evaluate-all": {"task": "slo.evaluate_all", "schedule": every, "options": options("slo", every)},
        "alerts-detect-regressions": {"task": "alerts.detect_regressions", "schedule": alerts_every,
                                      "options": options("alerts", alerts_every)},
        "alerts-check-repeats": {"task": "alerts.check_repeats", "schedule": alerts_every,
                                 "options": options("alerts", alerts_every)},
        "notify-deliver-due": {"task": "notify.deliver_due", "schedule": deliver_every,
                               "options": options("notify", deliver_every)},
        "notify-prune-deliveries": {"task": "notify.prune_deliveries", "schedule": prune_every,
                                    "options": options("notify", prune_every)},
        "regressions-sweep": {"task": "regressions.sweep", "schedule": sweep_every,
                              "options": options("regressions", sweep_every)},
        "tuning-sweep": {"task": "tuning.sweep", "schedule": tuning_every, "options": options("tuning", tuning_every)},
        "tuning-calibrate-groups": {"task": "tuning.calibrate_groups", "schedule": calibrate_every,
                                    "options": options("tuning", calibrate_every)},
        "rollouts-sweep": {"task": "rollouts.sweep", "schedule": rollouts_every,
                           "options": options("rollouts", rollouts_every)},
        "loops-sweep": {"task": "loops.sweep", "schedule": loops_every, "options": options("loops", loops_every)},
    }


def _configure(sender=None, **kwargs) -> None:
    # One direct exchange per queue, named like it: routing never depends on Celery's default exchange.
    app.conf.task_queues = tuple(
        Queue(queue_name(q), Exchange(queue_name(q), type="direct"), routing_key=queue_name(q)) for q in QUEUES
    )
    app.conf.task_default_queue = queue_name("slo")
    app.conf.task_default_exchange = queue_name("slo")
    app.conf.task_default_routing_key = queue_name("slo")
    app.conf.task_routes = {f"{q}.*": {"queue": queue_name(q), "exchange": queue_name(q), "routing_key": queue_name(q)}
                            for q in QUEUES}
    app.conf.beat_schedule = beat_schedule()
    app.conf.beat_schedule_filename = str(settings.DATA_DIR / "celerybeat-schedule")
    app.conf.worker_hijack_root_logger = False
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        # kombu's own filesystem transport lets a consumer read a message file before it is written
        app.conf.broker_transport = "observatory.fs_broker:Transport"
        if settings.CELERY_BROKER_URL == "filesystem://":
            app.conf.broker_url = "filesystem://localhost/"  # the host is unused; kombu warns without one


app.on_after_configure.connect(_configure, weak=False)


@signals.worker_ready.connect(weak=False)
def _serve_worker_metrics(sender=None, **kwargs) -> None:
    """A standalone worker's own /metrics (OBSERVATORY_WORKER_METRICS_BIND): its tasks' counters live in its
    process, not in the platform's."""
    bind = settings.OBSERVATORY_WORKER_METRICS_BIND
    if not bind:
        return
    pool = getattr(getattr(sender, "controller", None), "pool_cls", None)
    if pool is not None and "prefork" in f"{getattr(pool, '__module__', '')}{pool}":
        log.warning("OBSERVATORY_WORKER_METRICS_BIND with the prefork pool: tasks run in child processes, whose "
                    "counters this endpoint does not see; run the worker with --pool threads")
    host, _, port = bind.rpartition(":")
    start_http_server(int(port), addr=host or "0.0.0.0")
    log.info("worker metrics on http://%s/metrics", bind)
app.autodiscover_tasks(lambda: [m.rsplit(".", 1)[0] for m in TASK_MODULES])
