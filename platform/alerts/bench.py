"""From the first bad minute to the page's webhook, with the default burn-rate tiers.

    PYTHONPATH=platform python -m alerts.bench [--phases 5,20,35,50] [--rate 20]

In a scratch data directory (embedded mode: SQLite + chdb in this process): a TTFT SLO (≤ 500 ms) with the
default tiers, a webhook channel to a local HTTP receiver, a day of good requests (`rate` per minute, with
their hour touches, as ingest records them) and, from minute T0 on, every request slow. The beat is played on
a virtual clock: `evaluate_all(now=tick)` — the real evaluation, alert lifecycle and diagnosis — at one tick a
minute, `phase` seconds into each minute; the page's delivery is real (notify.deliver_due to the receiver)
and timed on the wall clock, plus half of the 10 s delivery interval (the average wait for the notify beat).

Figure = tick of the firing evaluation − T0 + 5 s + measured delivery time, averaged over the phases:
- BENCH alert_first_bad_minute_to_webhook_s        99.9% objective: the 5 m / 1 h page tier trips once the
                                                   first bad minute has closed, then waits ALERTS_PAGE_FOR_SECONDS
                                                   (50 s, i.e. the next tick) in pending;
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

from traces import rollups


class _Receiver:
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


def _seed(store, project_id: int, since: dt.datetime, until: dt.datetime, per_minute: int, ttft_ms: float,
          version: int) -> None:
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


def run_scenario(slo, t0: dt.datetime, phase: float, receiver: _Receiver, max_minutes: int = 30) -> float | None:
    """Seconds from T0 to the page's arrival at the receiver (virtual detection + real delivery + 5 s)."""
    from django.conf import settings
    from notify.models import Delivery
    from notify.services import deliver_due
    from slo.evaluation import evaluate_all
    from slo.models import SLO

    from .models import Alert, AlertTransition

    Alert.objects.all().delete()
    AlertTransition.objects.all().delete()
    Delivery.objects.all().delete()
    SLO.objects.filter(pk=slo.pk).update(last_firing_tier="", last_state="", last_status=None)
    receiver.arrivals.clear()
    for minute in range(-2, max_minutes):
        tick = t0 + dt.timedelta(minutes=minute, seconds=phase)
        evaluate_all(now=tick)
        fired = AlertTransition.objects.filter(to_state="firing", notified=True, alert__slo=slo,
                                               alert__severity="page").first()
        if fired is None:
            continue
        started = time.time()
        deliver_due()
        deadline = time.time() + 30
        while not receiver.arrivals and time.time() < deadline:
            time.sleep(0.01)
        if not receiver.arrivals:
            raise RuntimeError("the page was not delivered")
        delivery = receiver.arrivals[0][0] - started
        beat_wait = float(getattr(settings, "NOTIFY", {}).get("DELIVER_INTERVAL_SECONDS", 10.0)) / 2
        return (tick - t0).total_seconds() + beat_wait + delivery
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="5,20,35,50", help="seconds into each minute at which the beat ticks")
    parser.add_argument("--rate", type=int, default=20, help="requests per minute")
    args = parser.parse_args(argv)
    phases = [float(p) for p in args.phases.split(",") if p.strip()]

    tmp = tempfile.TemporaryDirectory(prefix="alerts-bench-")
    os.environ["OBSERVATORY_DATA_DIR"] = tmp.name
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")
    os.environ["NOTIFY_ALLOW_PRIVATE_DESTINATIONS"] = "127.0.0.1:1024-65535"
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("CLICKHOUSE_URL", None)
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

    call_command("migrate", verbosity=0)
    store = get_store()
    ch_migrate.apply(store, log=lambda *_: None)
    receiver = _Receiver()
    project = Project.objects.create(name="bench")
    Channel.objects.create(project=project, name="pager", kind="webhook", url=receiver.url)
    # The timeline ends a little before the real now, so every row is within retention.
    t0 = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=40)).replace(second=0, microsecond=0)
    version = time.time_ns()
    _seed(store, project.id, t0 - dt.timedelta(days=1), t0, args.rate, 120.0, version)
    _seed(store, project.id, t0, t0 + dt.timedelta(minutes=35), args.rate, 2000.0, version + 1)

    results = {}
    for name, objective in (("alert_first_bad_minute_to_webhook_s", "99.9%"),
                            ("alert_first_bad_minute_to_webhook_99pct_s", "99%")):
        slo = services.create(project.id, {"name": f"ttft-{objective.rstrip('%').replace('.', '-')}",
                                           "sli": "ttft_ms", "threshold_ms": 500, "objective": objective})
        figures = []
        for phase in phases:
            figure = run_scenario(slo, t0, phase, receiver)
            if figure is None:
                raise SystemExit(f"{objective}: the page did not fire within 30 minutes")
            figures.append(figure)
        slo.enabled = False
        slo.save(update_fields=["enabled"])
        results[name] = (statistics.mean(figures), figures, objective)
    for name, (mean, figures, objective) in results.items():
        detail = ", ".join(f"{f:.1f}" for f in figures)
        print(f"# {objective} objective, default tiers, beat phases {args.phases} s: {detail} s", flush=True)
        print(f"BENCH {name}={mean:.1f} s", flush=True)
    receiver.server.shutdown()
    store.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
