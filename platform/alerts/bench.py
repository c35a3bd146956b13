"""From the first bad minute to the page's webhook, with the default burn-rate tiers and the default beat.

    PYTHONPATH=platform python -m alerts.bench [--phases 0.6,1.9,3.1,4.4] [--rate 20]

In a scratch data directory (embedded mode: SQLite + chdb in this process): a TTFT SLO (≤ 500 ms) with the
default tiers, a webhook channel to a local HTTP receiver, a day of good requests (`rate` per minute, with
their hour touches, as ingest records them) and, from T0 on, every request slow. The beat is played on a
virtual clock: `evaluate_all(now=tick)` — the real evaluation, alert lifecycle and diagnosis — every
SLO_EVALUATE_INTERVAL_SECONDS (5 s), `phase` seconds into each interval (default: four phases spread over it).
The delivery is real and timed on the wall clock from the start of the firing evaluation: the page's
transition asks for a delivery round when it commits (notify.services.deliver_soon), a Celery worker in this
process (thread pool, as runplatform's) takes it from the filesystem broker and sends the webhook.

Figure = tick of the firing evaluation − T0 + the wall time from that evaluation's start to the webhook's
arrival, averaged over the phases (the slowest phase is printed too):
- BENCH alert_first_bad_minute_to_webhook_s        99.9% objective: the 1 h / 5 m page tier (14.4×) trips once
                                                   1.44% of the last hour is bad, i.e. after 0.864 minutes of total
                                                   failure (52 s, the 18th bad request at 20 per minute), at the
                                                   next evaluation; a page has no pending period;
- BENCH alert_first_bad_minute_to_webhook_max_s    the same, its slowest phase;
- BENCH alert_first_bad_minute_to_webhook_99pct_s  99% objective: 14.4 × 1% = 14.4% of the last hour must be bad,
                                                   which takes 8.64 minutes of total failure.
What it leaves out: ingest lag (a request is visible about a second after its spans arrive) and the time a
slow request takes to finish (its row exists once it completes).
"""
from __future__ import annotations

import argparse
import datetime as dt
import http.server
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from celery import bootsteps, current_app
from celery.worker import WorkController, state
from django.conf import settings
from traces import rollups


class Receiver:
    """A local HTTP server that keeps each POST's arrival time and JSON body."""

    def __init__(self):
        self.arrivals: list[tuple[float, dict]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.arrivals.append((time.time(), json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"


def seed_traffic(store, project_id: int, since: dt.datetime, until: dt.datetime, per_minute: int, ttft_ms: float,
                 version: int) -> None:
    """`per_minute` requests a minute over [since, until), evenly spaced from `since`, all with this TTFT."""
    step_us = int(60e6 / per_minute)
    count = int((until - since).total_seconds() * 1e6 // step_us)
    store.tenant_command(
        f"INSERT INTO {store.table('llm_requests')} (project_id, trace_id, request_key, request_id, start_time, "
        "service, model, engine_config, prompt_tokens, completion_tokens, prompt_bucket, e2e_ms, ttft_ms, "
        "engine_ttft_ms, tpot_ms, network_ms, overhead_ms, queue_ms, prefill_ms, decode_ms, hops, status, version, "
        "is_deleted, retention_days) "
        "SELECT {project_id:UInt32}, lower(hex(sipHash128(number, {version:UInt64}))), "
        "lower(hex(sipHash64(number, {version:UInt64}))), '', "
        "fromUnixTimestamp64Micro(toInt64({start_us:Int64} + number * {step_us:Int64})), 'chat', 'llama-8b', "
        "'cfg-a', 300, 64, '<1k', {ttft:Float64} + 630, {ttft:Float64}, {ttft:Float64} - 5, 10, 5, 3, "
        "{ttft:Float64} - 48, 40, 630, '[]', 'ok', {version:UInt64}, 0, 30 FROM numbers({count:UInt64})",
        project_id=project_id,
        parameters={"start_us": int(since.timestamp() * 1e6), "step_us": step_us, "count": count,
                    "ttft": ttft_ms, "version": version},
    )
    hours = set()
    hour = since.replace(minute=0, second=0, microsecond=0)
    while hour < until:
        hours.add(int(hour.timestamp()))
        hour += dt.timedelta(hours=1)
    rollups.record_touches(store, project_id, hours, version)


def run_scenario(slo, t0: dt.datetime, phase: float, receiver: Receiver, *, interval: float, max_minutes: int = 30,
                 wait_seconds: float = 30.0) -> float | None:
    """Seconds from T0 to the page's arrival at the receiver: virtual detection (the firing tick) + the wall time
    from that evaluation's start to the arrival. None when no page fires within `max_minutes`; an error when one
    fires before T0 (a false page on the good day) or is not delivered within `wait_seconds`."""
    from notify.models import Delivery
    from slo.evaluation import evaluate_all
    from slo.models import SLO

    from .models import Alert, AlertTransition

    Alert.objects.all().delete()
    AlertTransition.objects.all().delete()
    Delivery.objects.all().delete()
    SLO.objects.filter(pk=slo.pk).update(last_firing_tier="", last_state="", last_status=None)
    receiver.arrivals.clear()
    step = dt.timedelta(seconds=interval)
    tick = t0 - dt.timedelta(minutes=2) + dt.timedelta(seconds=phase)
    while tick < t0 + dt.timedelta(minutes=max_minutes):
        started = time.time()
        evaluate_all(now=tick)
        fired = AlertTransition.objects.filter(to_state="firing", notified=True, alert__slo=slo,
                                               alert__severity="page").first()
        if fired is None:
            tick += step
            continue
        if tick < t0:
            raise RuntimeError(f"a page fired at {tick}, before the first bad request at {t0}")
        deadline = time.time() + wait_seconds
        while not receiver.arrivals and time.time() < deadline:
            time.sleep(0.002)
        if not receiver.arrivals:
            raise RuntimeError("the page was not delivered")
        return (tick - t0).total_seconds() + receiver.arrivals[0][0] - started
    return None


def default_phases(interval: float, count: int = 4) -> list[float]:
    """`count` ticks' offsets spread evenly over one evaluation interval."""
    return [round(interval * (i + 0.5) / count, 3) for i in range(count)]


def start_worker():
    """A Celery worker with a thread pool in this process, consuming every queue as runplatform's does; returns
    (worker, thread) once it is ready."""
    for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
        folder = (settings.CELERY_BROKER_TRANSPORT_OPTIONS or {}).get(key)
        if folder:
            os.makedirs(folder, exist_ok=True)
    app = current_app._get_current_object()
    app.loader.import_default_modules()
    worker = WorkController(app=app, hostname=f"alerts-bench-{os.getpid()}@localhost", pool_cls="threads",
                            concurrency=2, queues=[q.name for q in app.conf.task_queues], without_heartbeat=True,
                            without_mingle=True, without_gossip=True, optimization="fair")
    thread = threading.Thread(target=worker.start, name="celery-worker", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while getattr(getattr(getattr(worker, "consumer", None), "blueprint", None), "state", None) != bootsteps.RUN:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the Celery worker did not start within 60 s")
        time.sleep(0.05)
    return worker, thread


def stop_worker(thread: threading.Thread) -> None:
    state.should_stop = 0  # asked, not forced: the consumer loop stops at its next turn
    thread.join(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="", help="seconds into each evaluation interval at which the beat ticks "
                                                     "(default: four spread over it)")
    parser.add_argument("--rate", type=int, default=20, help="requests per minute")
    args = parser.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="alerts-bench-")
    os.environ["OBSERVATORY_DATA_DIR"] = tmp.name
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")
    os.environ["NOTIFY_ALLOW_PRIVATE_DESTINATIONS"] = "127.0.0.1:1024-65535"
    for name in ("DATABASE_URL", "CLICKHOUSE_URL", "CELERY_BROKER_URL", "CELERY_TASK_ALWAYS_EAGER"):
        os.environ.pop(name, None)
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    import django

    django.setup()
    from django.core.management import call_command
    from notify.models import Channel
    from slo import services
    from tenancy.models import Project
    from traces import ch_migrate
    from traces.store import get_store

    interval = float(settings.SLO["EVALUATE_INTERVAL_SECONDS"])
    phases = [float(p) for p in args.phases.split(",") if p.strip()] or default_phases(interval)
    call_command("migrate", verbosity=0)
    store = get_store()
    ch_migrate.apply(store, log=lambda *_: None)
    receiver = Receiver()
    _worker, thread = start_worker()
    project = Project.objects.create(name="bench")
    Channel.objects.create(project=project, name="pager", kind="webhook", url=receiver.url)
    # The timeline ends a little before the real now, so every row is within retention.
    t0 = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=40)).replace(second=0, microsecond=0)
    version = time.time_ns()
    seed_traffic(store, project.id, t0 - dt.timedelta(days=1), t0, args.rate, 120.0, version)
    seed_traffic(store, project.id, t0, t0 + dt.timedelta(minutes=35), args.rate, 2000.0, version + 1)

    results = {}
    for name, objective in (("alert_first_bad_minute_to_webhook_s", "99.9%"),
                            ("alert_first_bad_minute_to_webhook_99pct_s", "99%")):
        slo = services.create(project.id, {"name": f"ttft-{objective.rstrip('%').replace('.', '-')}",
                                           "sli": "ttft_ms", "threshold_ms": 500, "objective": objective})
        figures = []
        for phase in phases:
            figure = run_scenario(slo, t0, phase, receiver, interval=interval)
            if figure is None:
                raise SystemExit(f"{objective}: the page did not fire within 30 minutes")
            figures.append(figure)
        slo.enabled = False
        slo.save(update_fields=["enabled"])
        results[name] = (figures, objective)
    stop_worker(thread)
    phase_text = ", ".join(f"{p:g}" for p in phases)
    for name, (figures, objective) in results.items():
        detail = ", ".join(f"{f:.1f}" for f in figures)
        print(f"# {objective} objective, default tiers, evaluation every {interval:g} s at phases {phase_text} s, "
              f"page pending period {settings.ALERTS['PAGE_FOR_SECONDS']:g} s: {detail} s", flush=True)
        print(f"BENCH {name}={statistics.mean(figures):.1f} s", flush=True)
        if name == "alert_first_bad_minute_to_webhook_s":
            print(f"BENCH alert_first_bad_minute_to_webhook_max_s={max(figures):.1f} s", flush=True)
    receiver.server.shutdown()
    store.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
