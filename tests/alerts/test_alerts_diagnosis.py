"""Diagnosis and the regression detector on request rows seeded into a real (scratch) ClickHouse store: the
component that moved, the contributor that carries it, and the vLLM knob the suggestion names."""
from __future__ import annotations

import datetime as dt
import http.server
import threading
import uuid

import pytest
from alerts import diagnosis, regression
from alerts.models import Alert
from alerts_support import insert_requests, spread
from fleet import replica_metrics
from tenancy.models import Project

NOW = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=3)).replace(second=0, microsecond=0)
MIN = dt.timedelta(minutes=1)
BURNING = (NOW - 10 * MIN, NOW)
BASELINE = (NOW - 40 * MIN, NOW - 10 * MIN)


def seed(store, service: str, baseline: dict, burning: list[dict], project_id: int = 1, n: int = 300):
    rows = spread(project_id, *BASELINE, n, service=service, **baseline)
    for i, kwargs in enumerate(burning):
        rows += spread(project_id, *BURNING, kwargs.pop("n", 100), seed=10 + i, service=service, **kwargs)
    insert_requests(store, rows)


def run(store, service, sli="ttft_ms", threshold_ms=200.0, engine=None):
    return diagnosis.diagnose(1, {"service": [service]}, BURNING, BASELINE, sli=sli, threshold_ms=threshold_ms,
                              store=store, engine=engine or {})


def test_queue_dominated_burn_names_queue_the_config_and_max_num_seqs(store):
    seed(store, "q", {"queue": 10.0}, [{"queue": 12.0, "engine_config": "cfg-big"},
                                       {"queue": 1500.0, "engine_config": "cfg-small"}])
    engine = {"source": "fleet controller",
              "configs": {"cfg-small": {"max_num_seqs": 2, "groups": ["small"], "replicas": 1}}}
    d = run(store, "q", engine=engine)
    assert d["dominant_component"] == "queue"
    assert d["components"]["queue"]["delta_mean_ms"] == pytest.approx(750, rel=0.1)
    assert d["components"]["decode"]["relevant"] is False, "TTFT has no decode time"
    assert d["burning"]["requests"] == 200 and d["burning"]["bad"] == 100 and d["baseline"]["bad"] == 0
    assert d["top"]["engine_config"] == "cfg-small"
    [top] = [c for c in d["top_contributors"] if c["dimension"] == "engine_config"]
    assert top["bad_share"] == 1.0 and top["bad_ratio"] == 1.0
    assert d["suggestion_detail"]["knobs"] == ["max_num_seqs", "replicas"]
    assert "max_num_seqs (now 2; try 8)" in d["suggestion"] and "group small" in d["suggestion"]
    assert d["summary"].startswith("queue time rose")


def test_a_burn_local_to_one_replica_group_names_it_and_suggests_moving_traffic(store):
    # 90% of the traffic on the stable group (a few slow requests), 10% on a canary whose queue explodes.
    seed(store, "rg", {"queue": 10.0, "replica_group": "stable"},
         [{"n": 180, "queue": 12.0, "replica_group": "stable"},
          {"n": 10, "queue": 900.0, "replica_group": "stable"},
          {"n": 20, "queue": 1500.0, "replica_group": "canary"}])
    d = run(store, "rg")
    assert d["dominant_component"] == "queue"
    assert d["top"]["replica_group"] == "canary"
    [group] = [c for c in d["top_contributors"] if c["dimension"] == "replica_group"]
    assert group["bad"] == 20 and group["bad_share"] == pytest.approx(20 / 30)
    outlier = d["suggestion_detail"]["outlier"]
    assert (outlier["dimension"], outlier["value"]) == ("replica_group", "canary")
    assert outlier["bad_share"] == pytest.approx(20 / 30) and outlier["traffic_share"] == pytest.approx(20 / 210)
    assert "local to replica group canary: 67% of the bad events with 10% of the requests" in d["suggestion"]
    assert "PUT /fleet/weights" in d["suggestion"]
    assert "top replica_group canary (67% of bad events)" in d["summary"]


def test_a_burn_spread_over_groups_names_no_outlier(store):
    seed(store, "spread", {"queue": 10.0, "replica_group": "a"},
         [{"n": 100, "queue": 1500.0, "replica_group": "a"}, {"n": 100, "queue": 1500.0, "replica_group": "b"}])
    d = run(store, "spread")
    assert d["dominant_component"] == "queue" and "outlier" not in d["suggestion_detail"]
    assert "local to" not in d["suggestion"]


def test_prefill_of_long_prompts_suggests_chunked_prefill(store):
    seed(store, "p", {"prefill": 40.0}, [{"prefill": 45.0, "n": 50},
                                         {"prefill": 2500.0, "prompt_tokens": 9000, "prompt_bucket": "<16k"}])
    d = run(store, "p", threshold_ms=1000)
    assert d["dominant_component"] == "prefill"
    assert d["top"]["prompt_bucket"] == "<16k"
    assert {"enable_chunked_prefill", "long_prefill_token_threshold", "max_num_batched_tokens"} <= set(
        d["suggestion_detail"]["knobs"])


def _prefix_cache_rows(service: str, cached_share: float | None, collapsed_share: float | None) -> list[dict]:
    """2,000-token prompts; `cached_share` of them from the prefix cache and prefill 60 ms until 7 minutes before
    NOW, then `collapsed_share` and prefill 400 ms (None: no request reports cached tokens)."""
    collapse = NOW - 7 * MIN

    def cached(share):
        return None if share is None else int(2000 * share)

    common = dict(service=service, prompt_tokens=2000, prompt_bucket="<4k")
    rows = spread(1, BASELINE[0], collapse, 330, prefill=60.0, cached_prompt_tokens=cached(cached_share), **common)
    rows += spread(1, collapse, NOW, 70, seed=2, prefill=400.0, cached_prompt_tokens=cached(collapsed_share), **common)
    # The gateway's response cache answers as many requests, fast and without any engine: never in the diagnosis.
    rows += spread(1, *BURNING, 100, seed=3, service=service, prompt_tokens=2000, prompt_bucket="<4k",
                   served_from="exact_cache", lookup_ms=1.5, queue=0.0, prefill=0.0, decode=0.0, overhead=0.5)
    return rows


def test_a_prefill_burn_from_a_collapsed_prefix_cache_says_the_hit_ratio_fell_and_when(store):
    insert_requests(store, _prefix_cache_rows("pc", 0.78, 0.09))
    d = run(store, "pc")
    assert d["dominant_component"] == "prefill"
    assert d["burning"]["requests"] == 100, "response-cache hits are not the engine's requests"
    cache = d["prefix_cache"]
    assert cache["baseline"]["hit_ratio"] == pytest.approx(0.78, abs=0.001)
    burning_ratio = (30 * 1560 + 70 * 180) / (100 * 2000)  # 3 minutes before the collapse, 7 after
    assert cache["burning"]["hit_ratio"] == pytest.approx(burning_ratio, abs=0.001)
    assert cache["burning"]["requests"] == 100 and cache["direction"] == "fell"
    at = NOW - 7 * MIN
    assert cache["changed_at"] == at.strftime("%Y-%m-%dT%H:%M:%SZ")
    delta_p95 = d["components"]["prefill"]["delta_p95_ms"]
    assert 300 < delta_p95 < 400
    assert (f"prefill p95 +{delta_p95:.0f} ms; prefix-cache hit ratio fell from 78 % to "
            f"{burning_ratio * 100:.0f} % at {at:%H:%M} UTC") in d["summary"]
    assert "enable_prefix_caching" in d["suggestion_detail"]["knobs"]
    assert "prefix cache stopped serving prompt tokens" in d["suggestion"]
    # An SLO that counts response-cache hits gets them in its diagnosis too.
    with_hits = diagnosis.diagnose(1, {"service": ["pc"]}, BURNING, BASELINE, sli="ttft_ms", threshold_ms=200.0,
                                   store=store, engine={}, include_cached=True)
    assert with_hits["burning"]["requests"] == 200 and with_hits["prefix_cache"]["direction"] == "fell"


def test_without_cached_token_reports_or_a_material_move_the_diagnosis_says_nothing_of_caches(store):
    insert_requests(store, _prefix_cache_rows("pc-none", None, None) + _prefix_cache_rows("pc-flat", 0.50, 0.44))
    silent = run(store, "pc-none")
    assert silent["dominant_component"] == "prefill" and silent["prefix_cache"] is None
    assert "prefix-cache" not in silent["summary"] and "prefix cache" not in silent["suggestion"]
    assert "chunked prefill" in silent["suggestion"]  # long prompts: the usual advice
    flat = run(store, "pc-flat")
    assert flat["prefix_cache"]["direction"] is None and "less than the 10" in flat["prefix_cache"]["reason"]
    assert "prefix-cache" not in flat["summary"]


def test_decode_with_low_speculative_acceptance_suggests_turning_it_off(store):
    seed(store, "d", {"decode": 500.0}, [{"decode": 2000.0, "engine_config": "cfg-spec"}])
    engine = {"configs": {"cfg-spec": {"speculative_config": {"method": "ngram"}, "groups": ["canary"]}},
              "acceptance": {"cfg-spec": 0.12}}
    d = run(store, "d", sli="e2e_ms", threshold_ms=1500, engine=engine)
    assert d["dominant_component"] == "decode"
    assert "turn speculative decoding off" in d["suggestion"] and "12%" in d["suggestion"]
    without = run(store, "d", sli="tpot_ms", threshold_ms=20, engine={})
    assert without["dominant_component"] == "decode" and "enable speculative decoding" in without["suggestion"]


def test_network_between_client_and_gateway_points_at_the_client_region(store):
    seed(store, "n", {"network": 5.0, "client_gateway": 3.0, "gateway_engine": 2.0},
         [{"network": 400.0, "client_gateway": 395.0, "gateway_engine": 5.0}])
    d = run(store, "n")
    assert d["dominant_component"] == "network"
    assert "client region" in d["suggestion"]
    assert d["network_hops"]["client_gateway"]["burning_mean_ms"] == pytest.approx(395, rel=0.01)


def test_without_a_baseline_the_largest_share_dominates(store):
    insert_requests(store, spread(1, *BURNING, 50, service="fresh", queue=900.0))
    d = run(store, "fresh")
    assert d["baseline_usable"] is False and d["dominant_component"] == "queue"
    assert "no usable baseline" in d["dominant_reason"]
    assert d["components"]["queue"]["delta_mean_ms"] is None


def test_speculative_acceptance_is_read_from_vllm_metrics():
    text = (b"# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            b'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 1000.0\n'
            b"# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            b'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 150.0\n')

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert replica_metrics.speculative_acceptance([url, url]) == pytest.approx(0.15)
        assert replica_metrics.speculative_acceptance(["http://127.0.0.1:9"]) is None
    finally:
        server.shutdown()
        server.server_close()


# -- the regression detector ---------------------------------------------------------------------------------------
@pytest.fixture
def project(db, settings):
    settings.ALERTS = {**settings.ALERTS, "TICKET_FOR_SECONDS": 50.0, "REGRESSION_MIN_REQUESTS": 30}
    return Project.objects.create(name=f"p{uuid.uuid4().hex[:6]}")


def test_regression_fires_with_diagnosis_and_keeps_its_baseline(store, project):
    pid = project.id
    service = f"svc-{uuid.uuid4().hex[:6]}"
    base = dict(service=service, model="llama-8b", prefill=40.0)
    rows = spread(pid, NOW - 35 * MIN, NOW - 5 * MIN, 300, **base)
    rows += spread(pid, NOW - 5 * MIN, NOW + 2 * MIN, 70, seed=3, **{**base, "prefill": 900.0})
    # A pair that did not change, and one that doubled on too little traffic.
    rows += spread(pid, NOW - 35 * MIN, NOW + 2 * MIN, 370, seed=4, service=service, model="stable")
    rows += spread(pid, NOW - 35 * MIN, NOW - 5 * MIN, 300, seed=5, service=service, model="quiet")
    rows += spread(pid, NOW - 5 * MIN, NOW, 8, seed=6, service=service, model="quiet", decode=3000.0)
    # The gateway's response cache answers most of llama-8b's current requests in milliseconds: the engine's latency
    # regressed all the same, and the detector reads engine-served requests only.
    rows += spread(pid, NOW - 5 * MIN, NOW + 2 * MIN, 200, seed=9, **{**base, "prefill": 0.0}, served_from="exact_cache",
                   lookup_ms=1.0, queue=0.0, decode=0.0)
    insert_requests(store, rows)

    regression.detect_regressions(NOW, store=store, project_ids=[pid])
    alerts = Alert.objects.filter(project=project)
    pending = {(a.labels["model"], a.labels["metric"]): a.state for a in alerts}
    assert pending == {("llama-8b", "e2e_ms"): "pending", ("llama-8b", "ttft_ms"): "pending"}

    regression.detect_regressions(NOW + MIN, store=store, project_ids=[pid])
    ttft = Alert.objects.get(project=project, labels__model="llama-8b", labels__metric="ttft_ms")
    assert ttft.state == "firing" and ttft.kind == "latency_regression" and ttft.severity == "ticket"
    assert ttft.diagnosis["dominant_component"] == "prefill"
    assert ttft.diagnosis["filters"] == {"service": service, "model": "llama-8b"}
    assert ttft.last_values["ratio"] > 1.5 and ttft.labels["alertname"] == "LatencyRegression"
    frozen = ttft.context["baseline_p50"]

    # Forty minutes later the slow latency is all the rolling baseline knows: the frozen one keeps it firing.
    later = NOW + 40 * MIN
    insert_requests(store, spread(pid, NOW + 2 * MIN, later, 300, seed=7, **{**base, "prefill": 900.0}))
    regression.detect_regressions(later, store=store, project_ids=[pid])
    ttft.refresh_from_db()
    assert ttft.state == "firing" and ttft.context["baseline_p50"] == frozen
    # Back to normal: resolved.
    insert_requests(store, spread(pid, later, later + 6 * MIN, 60, seed=8, **base))
    regression.detect_regressions(later + 6 * MIN, store=store, project_ids=[pid])
    ttft.refresh_from_db()
    assert ttft.state == "resolved"
