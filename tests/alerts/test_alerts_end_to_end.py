"""End to end through real sockets: load generator → gateway → a simulated vLLM replica whose max_num_seqs is 2,
so requests queue → the platform's OTLP receiver → SLO evaluation (Celery beat and worker inside runplatform) →
the page → a signed webhook at a real HTTP receiver, whose diagnosis names queue time and max_num_seqs.

To keep it short the SLO has one fast page tier (14.4× over 2 min, confirmed over 1 min) and the platform
evaluates every 2 s with no pending period (ALERTS_PAGE_FOR_SECONDS=0, the default); with the default tiers the
same path is measured by `python -m alerts.bench`. The time from the first bad minute to the webhook is printed.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time

import pytest
from alerts_support import Receiver
from fleet_support import FleetPorts, exporting_to, group, run_engine, write_fleet

from engine.config import EngineConfig
from engine.loadgen import LengthRange, LoadSpec, run_load_sync
from engine.telemetry import build_tracer_provider

# An alert end to end from queueing traffic (~2.5 min). Run once, in embedded mode; exactly-once delivery under two
# workers and a doubled beat, the mode's part, is tests/alerts/test_alerts_exactly_once.py's, in both.
pytestmark = pytest.mark.one_suite(suite="embedded")

SMALL = {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "H100", "max_num_seqs": 2}
SLO_YAML = """
project: alpha
slos:
  - name: chat-ttft
    sli: ttft_ms
    threshold_ms: 200
    objective: 99%
    tiers:
      - {name: page-fast, severity: page, long_window: 2m, short_window: 1m, factor: 14.4}
"""


class Load(threading.Thread):
    """Load in 8-second rounds until stopped, keeping every round's records (wall-clock send times)."""

    def __init__(self, base_url: str, provider, rate: float, concurrency: int | None):
        super().__init__(daemon=True)
        self.spec = LoadSpec(base_url=base_url, arrival="constant", rate=rate, duration=8.0,
                             max_concurrency=concurrency, input_len=LengthRange(200, 200),
                             output_len=LengthRange(32, 32), seed=5, timeout=60)
        self.provider = provider
        self.stop_event = threading.Event()
        self.records: list[tuple[float, object]] = []  # (wall-clock send time, record)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                result = run_load_sync(self.spec, tracer_provider=self.provider)
                self.records += [(result.started_at + (r.sent_ms or r.scheduled_ms) / 1000, r) for r in result.records]
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def stop(self) -> None:
        self.stop_event.set()
        self.join(120)


def test_queueing_burns_a_ttft_slo_and_the_page_names_queue_time(tmp_path, fresh_platform_factory):
    receiver = Receiver()
    run_dir = tmp_path / "fleet"
    fleet_file = tmp_path / "fleet.yaml"
    platform = fresh_platform_factory(extra_env={
        "SLO_EVALUATE_INTERVAL_SECONDS": "2", "ALERTS_PAGE_FOR_SECONDS": "0",
        "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": "127.0.0.1:1024-65535",
        # The diagnosis reads the knobs of each config version from this fleet's controller.
        "ENGINE_FLEET": str(fleet_file), "ENGINE_RUN_DIR": str(run_dir),
    }, grpc=False)
    fleet_up = False
    provider = None
    try:
        ports = FleetPorts.free()
        ingest = {"authorization": f"Bearer {platform.keys['alpha']}"}
        write_fleet(fleet_file, name="alerts-e2e", run_dir=run_dir, ports=ports,
                    groups=[group("small", SMALL)], telemetry=exporting_to(platform.process, platform.keys["alpha"]))
        started = run_engine(fleet_file, "up", "--detach")
        assert started.returncode == 0, started.stdout + started.stderr
        fleet_up = True

        admin = platform.process.manage("create_api_token", "--user", "ops", "--role", "admin", "--project", "alpha")
        status, _, body = platform.process.post("/api/v1/channels?project=alpha", json.dumps({
            "name": "oncall", "kind": "webhook", "url": receiver.url,
            "severities": ["page"]}).encode(), {"Authorization": f"Bearer {admin}", "Content-Type": "application/json"})
        assert status == 201, body
        slo_file = tmp_path / "slo.yaml"
        slo_file.write_text(SLO_YAML)
        platform.process.manage("slo", "apply", str(slo_file))

        provider = build_tracer_provider("llm-loadgen", endpoint=f"{platform.url}/v1/traces",
                                         protocol="http/protobuf", headers=ingest)
        base_url = f"http://127.0.0.1:{ports.gateway}/v1"
        # A healthy start (the diagnosis baseline), then more concurrent requests than max_num_seqs = 2.
        healthy = run_load_sync(LoadSpec(base_url=base_url, arrival="constant", rate=2.0, duration=10.0,
                                         input_len=LengthRange(200, 200), output_len=LengthRange(32, 32), seed=4,
                                         timeout=60), tracer_provider=provider)
        assert all(r.success for r in healthy.records), [r.error for r in healthy.records if not r.success]
        load = Load(base_url, provider, rate=30.0, concurrency=16)
        load.start()
        deadline = time.monotonic() + 200
        page = None
        while time.monotonic() < deadline and page is None and load.is_alive():
            page = next((r for r in receiver.requests if r["body"]["status"] == "firing"), None)
            time.sleep(0.25)
        load.stop()
        assert load.error is None, load.error
        assert page is not None, f"no page within 200 s: {platform.process.log_tail()}"

        event = page["body"]
        assert event["severity"] == "page" and event["labels"]["slo"] == "chat-ttft"
        assert page["headers"]["webhook-signature"].startswith("v1,") and page["headers"]["webhook-id"]
        diagnosis = event["diagnosis"]
        assert diagnosis["dominant_component"] == "queue", diagnosis
        assert diagnosis["top"]["engine_config"] == EngineConfig.from_dict(SMALL).version
        assert diagnosis["top"]["replica_group"] == "small"  # from the replica's resource attributes
        assert "top replica_group small" in diagnosis["summary"]
        assert "max_num_seqs (now 2" in diagnosis["suggestion"] and "group small" in diagnosis["suggestion"]
        assert diagnosis["engine_knobs_source"] == "fleet controller"

        # The alert as the API shows it.
        status, answer = platform.process.get("/api/v1/alerts?severity=page", platform.tokens["alice"])
        assert status == 200 and answer["alerts"][0]["state"] == "firing"
        assert answer["alerts"][0]["diagnosis"]["dominant_component"] == "queue"

        bad = sorted(t for t, r in load.records if r.success and r.ttft_ms is not None and r.ttft_ms > 200)
        assert bad, "the overload should have produced slow first tokens"
        first_bad = dt.datetime.fromtimestamp(bad[0], dt.timezone.utc)
        first_bad_minute = first_bad.replace(second=0, microsecond=0)
        arrived = page["at"]
        from_minute = arrived - first_bad_minute.timestamp()
        print(f"\nfirst bad minute → page webhook: {from_minute:.1f} s "
              f"(first slow request → webhook: {arrived - bad[0]:.1f} s; 2m/1m tier, 2 s evaluation interval, "
              f"delivered on commit)")
        # Expected: 14.4% of the last 2 minutes' requests slow, then the next evaluation (≤ 2 s) and the delivery
        # asked for on commit; the rest is ingest and decomposition lag.
        assert from_minute <= 150, from_minute
    finally:
        if provider is not None:
            provider.shutdown()
        if fleet_up:
            run_engine(fleet_file, "down")
        receiver.close()


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
