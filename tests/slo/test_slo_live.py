"""SLOs on a live platform: the JSON API with an operator (carol), a teammate viewer (alice) and an outsider (bob);
OTLP traffic evaluated by the platform's own Celery worker and beat (in-process; Redis in server mode), burn
rates, budget, state and the status history read back through the API."""
from __future__ import annotations

import datetime as dt
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from otlp_payloads import MS, engine_span, export_protobuf, pb_request, vllm_resource
from prometheus_client.parser import text_string_to_metric_families

ENV = {"SLO_EVALUATE_INTERVAL_SECONDS": "1", "SLO_SETTLE_SECONDS": "0"}
TTFT_SLO = {"name": "chat-ttft", "description": "first token", "sli": "ttft_ms", "threshold_ms": 500,
            "objective": "99%", "filters": {"service": "chat-app"}}


def root_conftest(config):
    """tests/conftest.py as pytest loaded it (`import conftest` may find another directory's conftest)."""
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    for plugin in config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == path:
            return plugin
    raise RuntimeError(f"{path} is not loaded")


@pytest.fixture(scope="module")
def platform(request):
    live, cleanup = root_conftest(request.config).start_platform(extra_env=ENV, grpc=False)
    live.tokens["carol"] = live.process.manage(
        "create_api_token", "--user", "carol", "--role", "operator", "--project", "alpha")
    try:
        yield live
    finally:
        cleanup()


def call(platform, method: str, path: str, token: str | None, body=None) -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(platform.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def send(platform, project: str, specs: list[tuple[float, float, bool]], service: str = "chat-app") -> None:
    """specs: (seconds ago, ttft seconds, failed) per engine-only request."""
    now = time.time_ns()
    spans = []
    for ago, ttft, failed in specs:
        span = engine_span(start_ns=now - int(ago * 1000) * MS, ttft_s=ttft, e2e_s=ttft + 0.5, prefill_s=ttft / 2,
                           queue_s=ttft / 2, decode_s=0.4)
        if failed:
            span.status.code = 2
        spans.append(span)
    export_protobuf(platform, pb_request((vllm_resource(service=service), spans)), platform.keys[project])


def wait_for(platform, token: str, name: str, predicate, timeout: float = 45.0, project: str | None = None) -> dict:
    deadline = time.time() + timeout
    query = f"?project={project}" if project else ""
    body = None
    while time.time() < deadline:
        status, body = call(platform, "GET", f"/api/v1/slos/{name}{query}", token)
        assert status == 200, body
        if body["status"]["last_evaluated_at"] and predicate(body):
            return body
        time.sleep(0.25)
    raise AssertionError(f"SLO {name} never reached the expected status: {json.dumps(body)[:2000]}\n"
                         f"{platform.process.log_tail()}")


def test_operator_creates_reads_replaces_deletes_and_others_cannot(platform):
    carol, alice, bob = platform.tokens["carol"], platform.tokens["alice"], platform.tokens["bob"]
    definition = {**TTFT_SLO, "name": "crud-check"}
    status, body = call(platform, "POST", "/api/v1/slos", alice, definition)
    assert (status, body["error"]) == (
        403, "this token needs the operator role in project alpha for creating an SLO (it has viewer)")
    status, body = call(platform, "POST", "/api/v1/slos", carol, definition)
    assert status == 201, body
    assert body["project"] == "alpha" and body["objective"] == 0.99 and body["objective_percent"] == "99%"
    assert body["default_tiers"] is True and [t["name"] for t in body["tiers"]][0] == "page-1h"
    assert body["status"]["state"] == "pending"
    status, body = call(platform, "POST", "/api/v1/slos", carol, definition)
    assert status == 409 and "already exists" in body["error"]
    # the teammate reads it; the outsider does not see the project at all
    status, body = call(platform, "GET", "/api/v1/slos", alice)
    assert status == 200 and "crud-check" in [s["name"] for s in body["slos"]]
    status, body = call(platform, "GET", "/api/v1/slos/crud-check?project=alpha", bob)
    assert status == 404 and body["error"] == "no project named 'alpha' for this token"
    status, body = call(platform, "GET", "/api/v1/slos", bob)
    assert status == 200 and body == {"project": "beta", "slos": []}
    status, body = call(platform, "GET", "/api/v1/slos/crud-check", bob)
    assert status == 404
    # replace: the same validation as YAML, every problem listed
    status, body = call(platform, "PUT", "/api/v1/slos/crud-check", carol, {**definition, "objective": "90%"})
    assert status == 400 and "tier page-1h (14.4× over 1h" in body["error"] and len(body["problems"]) == 1
    status, body = call(platform, "PUT", "/api/v1/slos/crud-check", carol, {**definition, "objective": "99.5%"})
    assert status == 200 and body["objective"] == 0.995
    status, body = call(platform, "PUT", "/api/v1/slos/crud-check", alice, definition)
    assert status == 403
    status, body = call(platform, "PUT", "/api/v1/slos/crud-check", carol, {**definition, "name": "other"})
    assert status == 200 and body["name"] == "other"  # renamed
    status, body = call(platform, "DELETE", "/api/v1/slos/other", alice)
    assert status == 403
    status, body = call(platform, "DELETE", "/api/v1/slos/other", carol)
    assert (status, body) == (200, {"deleted": "other", "project": "alpha"})
    status, body = call(platform, "GET", "/api/v1/slos/other", carol)
    assert status == 404 and body["error"] == "no SLO named 'other' in this project"


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"not json", 400, "the body must be a JSON object"),
    ([1, 2], 400, "the body must be a JSON object"),
    ({"name": "x", "sli": "ttft_ms", "objective": "99%"}, 400, "threshold_ms: required with ttft_ms"),
    ({"name": "x", "sli": "error_ratio", "objective": "99%", "threshold_ms": 5}, 400,
     "threshold_ms: not allowed with error_ratio"),
    (b"{" + b" " * 70000 + b"}", 413, "the body is limited to 65536 bytes"),
])
def test_bad_bodies(platform, body, status, message):
    got_status, got = call(platform, "POST", "/api/v1/slos", platform.tokens["carol"], body)
    assert got_status == status and message in got["error"], got


def test_the_project_is_the_query_parameter_and_another_tenants_is_404(platform):
    got_status, got = call(platform, "POST", "/api/v1/slos?project=beta", platform.tokens["carol"], TTFT_SLO)
    assert (got_status, got["error"]) == (404, "no project named 'beta' for this token")


def test_methods_and_auth(platform):
    status, body = call(platform, "PATCH", "/api/v1/slos", platform.tokens["carol"], {})
    assert status == 405 and "use GET, POST" in body["error"]
    status, body = call(platform, "GET", "/api/v1/slos", None)
    assert status == 401
    status, body = call(platform, "POST", "/api/v1/slos/x/history", platform.tokens["carol"], {})
    assert status == 405


def test_traffic_burns_the_budget_pages_and_keeps_a_history(platform):
    carol, alice = platform.tokens["carol"], platform.tokens["alice"]
    status, body = call(platform, "POST", "/api/v1/slos", carol, TTFT_SLO)
    assert status == 201, body
    rare = {"name": "rare-ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99.9%",
            "filters": {"service": "rare-svc"}}
    assert call(platform, "POST", "/api/v1/slos", carol, rare)[0] == 201
    errors = {"name": "chat-errors", "sli": "error_ratio", "objective": "99%", "filters": {"service": "chat-app"}}
    assert call(platform, "POST", "/api/v1/slos", carol, errors)[0] == 201
    # 50 chat requests 70-110 s ago: 10 with a 2 s first token, 2 failed; 3 requests of a rare service, one slow
    specs = [(70 + i * 0.8, 2.0 if i % 5 == 0 else 0.1, i in (1, 2)) for i in range(50)]
    send(platform, "alpha", specs)
    send(platform, "alpha", [(80, 0.1, False), (85, 3.0, False), (90, 0.1, False)], service="rare-svc")
    send(platform, "beta", [(80, 5.0, False)] * 5, service="chat-app")  # another tenant's data never counts here
    platform.process.wait_idle()

    body = wait_for(platform, alice, "chat-ttft", lambda b: b["status"]["counts"].get("5m", {}).get("total") == 50)
    status_ = body["status"]
    assert status_["counts"]["5m"] == {"total": 50, "bad": 10}
    assert status_["counts"]["30d"] == {"total": 50, "bad": 10}
    assert status_["burn_rates"]["5m"] == pytest.approx(20.0)  # 20% bad / 1% budget
    assert status_["burn_rates"]["1h"] == pytest.approx(20.0)
    assert status_["budget_remaining"] == pytest.approx(-19.0)
    assert status_["state"] == "burning"
    assert status_["firing"]["name"] == "page-1h" and status_["firing"]["severity"] == "page"
    tiers = {t["name"]: t for t in status_["tiers"]}
    assert tiers["page-6h"]["burning"] and tiers["page-6h"]["suppressed"]
    assert tiers["ticket-1d"]["suppressed"]

    body = wait_for(platform, alice, "chat-errors", lambda b: b["status"]["counts"].get("1h", {}).get("total") == 50)
    assert body["status"]["counts"]["1h"] == {"total": 50, "bad": 2}
    assert body["status"]["burn_rates"]["1h"] == pytest.approx(4.0)
    # 4× reaches the ticket-1d tier (3×), but 2 bad requests are fewer than min_bad (3): guarded, not firing
    assert body["status"]["state"] == "low_traffic" and body["status"]["firing"] is None
    tiers = {t["name"]: t for t in body["status"]["tiers"]}
    assert tiers["ticket-1d"]["reason"] == "low traffic: 2 bad requests in 1d < min_bad 3"

    body = wait_for(platform, alice, "rare-ttft", lambda b: b["status"]["counts"].get("1h", {}).get("total") == 3)
    assert body["status"]["burn_rates"]["1h"] == pytest.approx(1000 / 3)
    assert body["status"]["state"] == "low_traffic" and body["status"]["firing"] is None

    # the list carries the same status
    status, listing = call(platform, "GET", "/api/v1/slos", alice)
    by_name = {s["name"]: s for s in listing["slos"]}
    assert by_name["chat-ttft"]["status"]["state"] == "burning"
    assert by_name["chat-ttft"]["status"]["burn_rates"]["5m"] == pytest.approx(20.0)

    # the status series, through ?series= and /history
    status, body = call(platform, "GET", "/api/v1/slos/chat-ttft?series=1h", alice)
    assert status == 200 and body["series"], body
    last = body["series"][-1]
    assert last["state"] == "burning" and last["firing_tier"] == "page-1h" and last["severity"] == "page"
    assert last["burn_rates"]["5m"] == pytest.approx(20.0) and last["counts"]["5m"] == {"total": 50, "bad": 10}
    status, history = call(platform, "GET", "/api/v1/slos/chat-ttft/history?limit=5", alice)
    assert status == 200 and 1 <= len(history["points"]) <= 5
    assert history["points"] == sorted(history["points"], key=lambda p: p["at"])
    status, body = call(platform, "GET", "/api/v1/slos/chat-ttft/history?limit=0", alice)
    assert status == 400 and "limit: a whole number from 1 to 10000" in body["error"]
    status, body = call(platform, "GET", "/api/v1/slos/chat-ttft?series=1y", alice)
    assert status == 400 and body["error"].startswith("series: a duration: digits and a unit")
    status, body = call(platform, "GET", "/api/v1/slos/chat-ttft/history", platform.tokens["bob"])
    assert status == 404


def test_yaml_applied_on_a_running_platform_is_evaluated_and_late_data_is_counted(platform, tmp_path):
    """SLOs loaded with `slo apply` while the platform runs; requests of a closed hour (built into buckets at
    once, SLO_SETTLE_SECONDS=0) and later spans for that same hour (the hour is rebuilt) are counted."""
    path = tmp_path / "beta.yaml"
    path.write_text("project: beta\nslos:\n"
                    "  - {name: e2e, sli: e2e_ms, threshold_ms: 1000, objective: 95%, no_data: keep, min_requests: 10,\n"
                    "     tiers: [{name: ticket-6h, severity: ticket, long_window: 6h, short_window: 30m, factor: 2}]}\n")
    output = platform.process.manage("slo", "apply", str(path))
    assert "+ beta/e2e" in output
    bob = platform.tokens["bob"]
    hours_ago = 3 * 3600
    send(platform, "beta", [(hours_ago, 0.1, False)] * 4 + [(hours_ago + 30, 2.0, False)] * 2, service="svc")
    platform.process.wait_idle()
    body = wait_for(platform, bob, "e2e", lambda b: b["status"]["counts"].get("6h", {}).get("total", 0) >= 6)
    # 5 from the earlier test (beta, e2e 5.5 s, 80 s ago) + 6 three hours ago: 4 fast (0.6 s), 2 slow (2.5 s)
    assert body["status"]["counts"]["6h"] == {"total": 11, "bad": 7}
    assert body["status"]["counts"]["30m"] == {"total": 5, "bad": 5}
    # late spans for the same closed hour: the hour's buckets are rebuilt and the counts follow
    send(platform, "beta", [(hours_ago + 60, 3.0, False)] * 3, service="svc")
    platform.process.wait_idle()
    body = wait_for(platform, bob, "e2e", lambda b: b["status"]["counts"]["6h"]["total"] == 14)
    assert body["status"]["counts"]["6h"] == {"total": 14, "bad": 10}
    assert body["status"]["state"] == "burning" and body["status"]["firing"]["name"] == "ticket-6h"


def scrape(platform, *tokens: str) -> dict:
    """The platform's /metrics → {(sample name, frozenset of label items): value}: once without a token, and once
    with each token (the per-SLO series come only with one, for its projects)."""
    samples = {}
    for token in (None, *tokens):
        request = urllib.request.Request(platform.url + "/metrics",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
        samples.update({(sample.name, frozenset(sample.labels.items())): sample.value
                        for family in text_string_to_metric_families(text) for sample in family.samples})
    return samples


def per_slo(samples: dict, name: str) -> dict:
    """{(project, slo): {other labels: value}} of one per-SLO family."""
    out: dict = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            labels = dict(labels)
            key = (labels.pop("project"), labels.pop("slo"))
            out.setdefault(key, {})[frozenset(labels.items())] = value
    return out


def test_metrics_expose_every_slo_as_the_api_reports_it(platform):
    """/metrics carries every SLO of every project under its own project's label, with the figures GET
    /api/v1/slos answers; the platform's own worker ran the evaluations and claimed the alert transitions."""
    readers = {"alpha": platform.tokens["alice"], "beta": platform.tokens["bob"]}
    for _attempt in range(30):
        before = scrape(platform, *readers.values())
        answers = {}
        for project, token in readers.items():
            status, body = call(platform, "GET", "/api/v1/slos", token)
            assert status == 200, body
            answers.update({(project, s["name"]): s for s in body["slos"]})
        samples = scrape(platform, *readers.values())
        stamps = per_slo(samples, "observatory_slo_last_evaluation_timestamp_seconds")
        # the evaluation of a new minute may land between the reads: read again until all three agree
        if stamps == per_slo(before, "observatory_slo_last_evaluation_timestamp_seconds") and all(
                stamps.get(key, {}).get(frozenset({"sli": s["sli"]}.items()))
                == dt.datetime.fromisoformat(s["status"]["last_evaluated_at"].replace("Z", "+00:00")).timestamp()
                for key, s in answers.items()):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"/metrics and the API never agreed on the evaluation times: {answers}")

    assert set(answers) == {("alpha", "chat-ttft"), ("alpha", "rare-ttft"), ("alpha", "chat-errors"), ("beta", "e2e")}
    assert set(per_slo(samples, "observatory_slo_objective_ratio")) == set(answers)
    for key, slo in answers.items():
        status, sli = slo["status"], frozenset({"sli": slo["sli"]}.items())
        assert per_slo(samples, "observatory_slo_objective_ratio")[key] == {sli: slo["objective"]}
        assert per_slo(samples, "observatory_slo_error_budget_remaining_ratio")[key] == {
            sli: pytest.approx(status["budget_remaining"])}
        firing = status["firing"] or {}
        assert per_slo(samples, "observatory_slo_state")[key] == {frozenset({
            "sli": slo["sli"], "state": status["state"], "firing_tier": firing.get("name", ""),
            "severity": firing.get("severity", "")}.items()): 1.0}
        rates = {dict(labels)["window"]: value
                 for labels, value in per_slo(samples, "observatory_slo_burn_rate")[key].items()}
        assert rates == {w: pytest.approx(r) for w, r in status["burn_rates"].items() if r is not None}
    assert per_slo(samples, "observatory_slo_burn_rate")["alpha", "chat-ttft"][
        frozenset({"sli": "ttft_ms", "window": "1h"}.items())] == pytest.approx(20.0)

    # evaluated in this process, by its in-process worker; the page of chat-ttft and the ticket of beta's e2e
    assert samples[("observatory_slo_evaluations_total", frozenset())] > 0
    assert samples[("observatory_slo_evaluation_seconds_count", frozenset())] > 0
    assert all(value == 0 for (name, _), value in samples.items()
               if name == "observatory_slo_evaluation_failures_total")
    for severity in ("page", "ticket"):
        labels = {"kind": "slo_burn", "severity": severity}
        assert samples[("observatory_alert_transitions_total", frozenset({**labels, "to": "pending"}.items()))] >= 1
        assert sum(samples[("observatory_alerts", frozenset({**labels, "state": state}.items()))]
                   for state in ("pending", "firing")) >= 1


def test_evaluation_ran_in_the_platform_without_errors(platform):
    """Evaluation runs in the platform process (its in-process worker and beat): no extra process was started."""
    status, body = call(platform, "GET", "/api/v1/slos?project=alpha", platform.tokens["carol"])
    assert all(s["status"]["last_evaluated_at"] for s in body["slos"])
    log = platform.process.log_tail(1_000_000)
    assert "SLO evaluation of project" not in log, log[-5000:]
    assert "slo.evaluate_all skipped" not in log


def test_openapi_describes_the_slo_answers(platform):
    status, document = call(platform, "GET", "/api/v1/openapi.json", None)
    assert status == 200
    assert {"/api/v1/slos", "/api/v1/slos/{name}", "/api/v1/slos/{name}/history"} <= set(document["paths"])
    assert set(document["paths"]["/api/v1/slos/{name}"]) == {"get", "put", "delete"}
    schemas = document["components"]["schemas"]
    status, body = call(platform, "GET", "/api/v1/slos/chat-ttft?series=1h", platform.tokens["alice"])
    assert status == 200
    assert set(body) <= set(schemas["Slo"]["properties"]), set(body) - set(schemas["Slo"]["properties"])
    assert set(body["status"]) <= set(schemas["SloStatus"]["properties"])
    assert set(body["status"]["tiers"][0]) <= set(schemas["SloTierStatus"]["properties"])
    assert set(body["series"][0]) <= set(schemas["SloStatusPoint"]["properties"])
    # what GET answers can be sent back with PUT unchanged
    status, again = call(platform, "PUT", "/api/v1/slos/chat-ttft", platform.tokens["carol"], body)
    assert status == 200, again
    assert {k: v for k, v in again.items() if k not in ("status", "updated_at")} == {
        k: v for k, v in body.items() if k not in ("status", "updated_at", "series")}
    assert again["default_tiers"] is True
