"""The SLI engine_model_error: each live check of a group's engine model (tuning.checks.record, as
calibration.refresh_live_error calls it) is one event, good when its worst |error| of p50 prefill time and TPOT is at
or under the SLO's threshold. Real components: the checks written to a scratch ClickHouse store, the SLO evaluated by slo.evaluation,
the alert driven by the alerts lifecycle with its diagnosis, the definition through the JSON API and the YAML
checks. Another project's checks never count."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import sys
from pathlib import Path

import pytest
from alerts.models import Alert, AlertState
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from notify.models import Channel, Delivery
from slo import definitions, evaluation, prometheus, queries, services
from slo.burn import WindowCounts
from slo.models import SLO, sli_key
from tenancy.models import ApiToken, Membership, Project
from tuning import checks
from tuning.calibration import live_worst
from tuning.models import EngineModel, ModelState

from engine.config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "alerts"))
from alerts_support import installed_store  # noqa: E402

CONFIG = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu_type="L4", max_model_len=4096)
FITS = {"ttft_ms_p50": 0.04, "prefill_ms_p50": 0.03, "tpot_ms_p50": -0.03, "ttft_ms_p95": 0.06, "tpot_ms_p95": 0.02}
# (predicted - observed) / observed: the model predicts a TPOT 38 % under what was served.
DRIFTED = {"ttft_ms_p50": -0.11, "prefill_ms_p50": -0.09, "tpot_ms_p50": -0.38, "ttft_ms_p95": -0.15,
           "tpot_ms_p95": -0.41}
# A load the group cannot keep up with: the queue moves the median TTFT several-fold; the model's costs still fit.
QUEUED = {"ttft_ms_p50": -0.74, "prefill_ms_p50": 0.06, "tpot_ms_p50": -0.04, "queue_ms_p50": -0.81}
SLOWER_DECODE = {"decode": 0.37, "prefill": 0.08}
# 90 %: a 10 % budget, so the 14.4x tier of the defaults cannot fire; 6x over 6h/30m pages, 1x over 3d tickets.
TIERS = [{"name": "page-6h", "severity": "page", "long_window": "6h", "short_window": "30m", "factor": 6},
         {"name": "ticket-3d", "severity": "ticket", "long_window": "3d", "short_window": "6h", "factor": 1}]
DEFINITION = {"name": "chat-model", "sli": "engine_model_error", "threshold": 0.2, "objective": "90%",
              "filters": {"replica_group": "chat"}, "tiers": TIERS}
FIVE_MINUTES = dt.timedelta(minutes=5)


@pytest.fixture(scope="module")
def store():
    with installed_store() as scratch:
        yield scratch


def engine_model(project: Project, group: str) -> EngineModel:
    now = timezone.now()
    return EngineModel.objects.create(
        project=project, group=group, config_version=CONFIG.version, config=CONFIG.to_dict(),
        window_start=now - dt.timedelta(hours=1), window_end=now, state=ModelState.FITTED, base_profile="L4",
        constants={"mfu": 0.4}, start_constants={"mfu": 0.45}, held_out_error=FITS)


def check_every_five_minutes(model: EngineModel, until: dt.datetime, count: int, errors: dict,
                             moved: dict | None = None) -> None:
    """`count` checks of `model`, one per 5 minutes, the last one 5 minutes before `until` (as the beat does)."""
    for i in range(count):
        assert checks.record(model, errors, live_worst(errors), moved or {"decode": 0.01}, 120,
                             until - FIVE_MINUTES * (count - i))


def test_an_slo_on_the_model_error_burns_on_bad_checks_and_pages_with_what_moved(db, store, settings):
    settings.ALERTS = {**settings.ALERTS, "PAGE_FOR_SECONDS": 0.0}
    alpha, beta = Project.objects.create(name="alpha"), Project.objects.create(name="beta")
    Channel.objects.create(project=alpha, name="hook", kind="webhook", url="http://127.0.0.1:9/hook")
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    chat, other = engine_model(alpha, "chat"), engine_model(alpha, "batch")
    # chat: 6 hours of checks, fitting for the first 2, then 4 hours drifted (a decode 37 % slower): 48 of 72 bad
    check_every_five_minutes(chat, now - dt.timedelta(hours=4), 24, FITS)
    check_every_five_minutes(chat, now, 48, DRIFTED, SLOWER_DECODE)
    # another group of the project, and the same group name in another project: neither counts for alpha's SLO
    check_every_five_minutes(other, now, 72, DRIFTED, SLOWER_DECODE)
    check_every_five_minutes(engine_model(beta, "chat"), now, 72, FITS)

    slo = services.create(alpha.id, DEFINITION)
    every_group = services.create(alpha.id, {**DEFINITION, "name": "every-group", "filters": {}})
    beta_slo = services.create(beta.id, DEFINITION)
    page, every, beta_eval = (evaluation.evaluate_project(store, p.id, [s], now)[0]
                              for p, s in ((alpha, slo), (alpha, every_group), (beta, beta_slo)))

    assert page.counts["30m"] == WindowCounts(6, 6) and page.counts["6h"] == WindowCounts(72, 48)
    assert page.counts["3d"] == WindowCounts(72, 48) and page.counts["30d"] == WindowCounts(72, 48)
    assert page.state == "burning" and page.firing.tier.name == "page-6h"
    assert page.burn_rates["6h"] == pytest.approx(48 / 72 / 0.1)
    assert every.counts["6h"] == WindowCounts(144, 120)  # both of alpha's groups, none of beta's
    assert beta_eval.counts["6h"] == WindowCounts(72, 0) and beta_eval.state == "ok"

    alert = Alert.objects.get(slo=slo, severity="page")
    assert alert.state == AlertState.FIRING
    assert alert.labels["sli"] == "engine_model_error" and alert.labels["replica_group"] == "chat"
    assert "90% of live checks of the engine model within 20% (p50 prefill time and TPOT)" in \
        alert.annotations["summary"]
    diagnosis = alert.diagnosis
    assert "components" not in diagnosis and "error" not in diagnosis, diagnosis  # not the request diagnosis
    assert diagnosis["sli"] == "engine_model_error" and diagnosis["engine_model"] == chat.id
    assert diagnosis["dominant_component"] == "decode"
    assert diagnosis["live_error"] == {"ttft_ms_p50": -0.11, "prefill_ms_p50": -0.09, "tpot_ms_p50": -0.38}
    [group] = diagnosis["groups"]  # the SLO's group only
    assert group["group"] == "chat" and group["checks"] == group["bad"] == 6  # the 30 minutes of the burn
    summary = diagnosis["summary"]
    assert summary.startswith(f"Engine model {chat.id} of group chat (config {CONFIG.version}) missed its latest "
                              "traffic by more than 20% in 6 of 6 live checks"), summary
    assert "p50 TPOT 38% under what was served, p50 prefill time 9% under; decode step time +37 %" in summary, summary
    assert diagnosis["suggestion"].startswith("A decode step reads the weights") and \
        "engine calibrate --project alpha --group chat" in diagnosis["suggestion"], diagnosis["suggestion"]
    [delivery] = Delivery.objects.filter(fingerprint=alert.fingerprint)
    assert "Diagnosis: Engine model" in delivery.event["description"]
    assert delivery.event["slo"]["threshold"] == 0.2

    # The model fits again (a new calibration): the last 30 minutes of checks good, the page resolves.
    check_every_five_minutes(chat, now + dt.timedelta(minutes=30), 6, FITS)
    [later] = evaluation.evaluate_project(store, alpha.id, [slo], now + dt.timedelta(minutes=30))
    assert later.counts["30m"] == WindowCounts(6, 0) and later.firing.tier.name == "ticket-3d"
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED


def test_a_check_without_traffic_measured_is_not_an_event_and_the_reasons_say_checks(db, store):
    # Groups of their own in each test: the metadata database is rolled back after each (project ids come again),
    # the scratch store is the module's.
    project = Project.objects.create(name="quiet")
    model = engine_model(project, "quiet")
    assert not checks.record(model, {"queue_ms_p50": 0.5}, live_worst({"queue_ms_p50": 0.5}), {}, 0,
                             timezone.now())  # no p50 prefill time or TPOT figure
    slo = services.create(project.id, {**DEFINITION, "no_data": "alert", "filters": {"replica_group": "quiet"}})
    [evaluated] = evaluation.evaluate_project(store, project.id, [slo], dt.datetime.now(dt.timezone.utc))
    assert evaluated.state == "no_data" and evaluated.firing.reason == "no data: no checks in 6h (no_data: alert)"


def test_a_check_the_store_refuses_is_logged_and_lost(db, caplog):
    class Refusing:
        def insert_encoded(self, *args, **kwargs):
            raise ConnectionError("ClickHouse away")

    import traces.store as store_module

    model = engine_model(Project.objects.create(name="away"), "chat")
    previous, store_module._store = store_module._store, Refusing()
    try:
        assert not checks.record(model, DRIFTED, live_worst(DRIFTED), SLOWER_DECODE, 100, timezone.now())
    finally:
        store_module._store = previous
    assert "live check of" in caplog.text and "not recorded" in caplog.text


def test_checks_keep_their_figures(db, store):
    project = Project.objects.create(name="figures")
    model = engine_model(project, "figures")
    at = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    assert checks.record(model, DRIFTED, live_worst(DRIFTED), SLOWER_DECODE, 321, at)
    [group] = queries.model_check_summary(store, project.id, groups=["figures"], since=at - FIVE_MINUTES,
                                          until=at + FIVE_MINUTES, threshold=0.2)
    assert group["checks"] == group["bad"] == 1
    assert group["latest"] == group["latest_bad"] == {
        "at": at.isoformat().replace("+00:00", "Z"), "model_id": model.id, "config_version": CONFIG.version,
        "worst_error": 0.38, "ttft_p50_error": -0.11, "prefill_p50_error": -0.09, "tpot_p50_error": -0.38,
        "requests": 321, "moved": SLOWER_DECODE}


def test_a_queue_that_moves_the_ttft_is_not_the_models_error(db, store):
    """Checks are judged on prefill time and TPOT, as a study's bound and the drift alert are: a queue that triples
    the median TTFT under overload burns no engine_model_error budget while the model's costs fit."""
    project = Project.objects.create(name="overloaded")
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    check_every_five_minutes(engine_model(project, "overloaded"), now, 72, QUEUED)
    slo = services.create(project.id, {**DEFINITION, "filters": {"replica_group": "overloaded"}})
    [evaluated] = evaluation.evaluate_project(store, project.id, [slo], now)
    assert evaluated.counts["6h"] == WindowCounts(72, 0) and evaluated.state == "ok"
    [group] = queries.model_check_summary(store, project.id, groups=["overloaded"], since=now - dt.timedelta(hours=6),
                                          until=now, threshold=0.2)
    assert group["bad"] == 0 and group["latest"]["worst_error"] == pytest.approx(0.06)
    assert group["latest"]["ttft_p50_error"] == -0.74  # kept, for reading


def test_a_check_written_before_prefill_time_was_kept_is_read_with_its_ttft(db, store):
    """Rows of ClickHouse migrations before 0015 have no prefill figure: they were judged on p50 TTFT and TPOT, and
    the diagnosis names TTFT for them."""
    from alerts.model_check_diagnosis import diagnose_model_checks

    project = Project.objects.create(name="older")
    model = engine_model(project, "older")
    at = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    queries.insert_model_check(store, project.id, {
        "at": at, "group": "older", "model_id": model.id, "config_version": CONFIG.version, "worst_error": 0.31,
        "ttft_p50_error": 0.31, "tpot_p50_error": 0.05, "requests": 90, "moved": {"prefill": 0.3}})
    diagnosis = diagnose_model_checks(project.id, {"replica_group": ["older"]}, (at - FIVE_MINUTES, at + FIVE_MINUTES),
                                      threshold=0.2, store=store)
    assert diagnosis["burning"]["bad_checks"] == 1
    assert diagnosis["live_error"] == {"ttft_ms_p50": 0.31, "tpot_ms_p50": 0.05}
    assert "p50 TTFT 31% over what was served, p50 TPOT 5% over" in diagnosis["summary"], diagnosis["summary"]


# -- the definition ----------------------------------------------------------------------------------------------
def test_a_definition_takes_a_ratio_threshold_and_the_group():
    fields = definitions.validate(DEFINITION)
    assert fields["sli"] == "engine_model_error" and fields["threshold"] == 0.2 and fields["threshold_ms"] is None
    assert fields["filters"] == {"replica_group": ["chat"]}
    slo = SLO(**fields)
    assert definitions.validate(definitions.render(slo)) == fields
    assert definitions.render(slo)["threshold"] == 0.2 and "threshold_ms" not in definitions.render(slo)
    assert sli_key("engine_model_error", None, {"replica_group": ["chat"]}, threshold=0.2) != \
        sli_key("engine_model_error", None, {"replica_group": ["chat"]}, threshold=0.3)


def test_the_request_slis_keep_their_keys():
    """The ratio threshold joins the key of engine_model_error only: every existing SLO keeps its series."""
    for sli, threshold_ms in (("ttft_ms", 500.0), ("error_ratio", None)):
        canonical = json.dumps({"sli": sli, "threshold_ms": threshold_ms, "filters": {"service": ["chat"]}},
                               sort_keys=True, separators=(",", ":"))
        before = int.from_bytes(hashlib.blake2b(canonical.encode(), digest_size=8).digest(), "big") >> 1
        slo = SLO(**definitions.validate({"name": "x", "sli": sli, "objective": "99%", "filters": {"service": "chat"},
                                          **({"threshold_ms": threshold_ms} if threshold_ms else {})}))
        assert slo.threshold is None and slo.sli_key == before


def test_a_bad_definition_is_refused_with_every_problem():
    with pytest.raises(definitions.DefinitionError) as refused:
        definitions.validate({**DEFINITION, "threshold": 1.5, "threshold_ms": 500, "include_cached": True,
                              "filters": {"replica_group": "chat", "service": "chat-app", "model": "llama"}})
    problems = refused.value.problems
    assert len(problems) == 4, problems
    assert any(p.startswith("threshold: engine_model_error needs") and "not 1.5" in p for p in problems)
    assert any(p.startswith("threshold_ms: engine_model_error's threshold is a ratio") for p in problems)
    assert any(p.startswith("include_cached:") for p in problems)
    assert "filters: engine_model_error counts live checks of a replica group's engine model, which only " \
           "replica_group selects; remove service, model" in problems
    for threshold in (0, -0.1, True, "20%", None):
        with pytest.raises(definitions.DefinitionError, match="threshold: engine_model_error needs"):
            definitions.validate({**DEFINITION, "threshold": threshold})
    assert definitions.validate({**DEFINITION, "threshold": 1})["threshold"] == 1.0
    with pytest.raises(definitions.DefinitionError, match="threshold: only engine_model_error takes a ratio "
                                                          "threshold; a latency SLI takes threshold_ms"):
        definitions.validate({"name": "x", "sli": "ttft_ms", "threshold_ms": 500, "threshold": 0.2, "objective": 0.99})


def test_prometheus_rules_leave_it_out_with_a_warning(db):
    """vLLM's metrics have no model checks: the SLO is left out as a disabled one is, not an export failure."""
    project = Project.objects.create(name="rules")
    slo = services.create(project.id, DEFINITION)
    export = prometheus.export([slo], platform=False)
    assert export.document == {"groups": []} and export.skipped == []
    [warning] = export.warnings
    assert warning.startswith("rules/chat-model: engine_model_error counts the platform's live checks"), warning


def test_the_api_creates_reads_and_refuses_it(db):
    project = Project.objects.create(name="api")
    user = get_user_model().objects.create(username="olga")
    Membership.objects.create(user=user, project=project, role="operator")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {ApiToken.issue(user, role='operator')[1]}"}

    def call(method, path, body=None):
        response = getattr(Client(), method)(path, data=json.dumps(body), content_type="application/json", **headers) \
            if body is not None else getattr(Client(), method)(path, **headers)
        return response.status_code, response.json()

    status, created = call("post", "/api/v1/slos", DEFINITION)
    assert status == 201, created
    assert created["sli"] == "engine_model_error" and created["threshold"] == 0.2 and created.get("threshold_ms") is None
    status, read = call("get", "/api/v1/slos/chat-model")
    assert status == 200 and read["filters"] == {"replica_group": ["chat"]}
    status, replaced = call("put", "/api/v1/slos/chat-model", {**read, "threshold": 0.3})
    assert status == 200 and replaced["threshold"] == 0.3, replaced

    status, refused = call("post", "/api/v1/slos", {**DEFINITION, "name": "bad",
                                                    "filters": {"replica_group": "chat", "service": "a", "model": "b"}})
    assert status == 400
    assert refused["problems"] == [{"field": "filters", "location": "body", "reason": (
        "engine_model_error counts live checks of a replica group's engine model, which only replica_group selects; "
        "remove model, service")}], refused
    status, refused = call("post", "/api/v1/slos", {**DEFINITION, "name": "bad", "threshold": 2, "threshold_ms": 5})
    assert status == 400 and {p["field"] for p in refused["problems"]} == {"threshold", "threshold_ms"}, refused
    status, refused = call("post", "/api/v1/slos", {"name": "bad", "sli": "e2e_ms", "threshold_ms": 900,
                                                    "threshold": 0.2, "objective": "99%"})
    assert status == 400 and [p["field"] for p in refused["problems"]] == ["threshold"], refused
    status, document = call("get", "/api/v1/openapi.json")
    assert status == 200 and "EngineModelErrorSlo" in json.dumps(document["components"]["schemas"])


def test_the_api_takes_what_the_document_allows_and_refuses_what_it_does_not(db):
    """What the API fuzzer found: include_cached 0 (the document: the boolean false) was taken for false, so a PUT
    the document refuses replaced the SLO (and renamed it); a null name or a null filter dimension, both allowed by
    the document, were refused (400)."""
    project = Project.objects.create(name="fuzzed")
    user = get_user_model().objects.create(username="flo")
    Membership.objects.create(user=user, project=project, role="operator")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {ApiToken.issue(user, role='operator')[1]}"}

    def call(method, path, body):
        response = getattr(Client(), method)(path, data=json.dumps(body), content_type="application/json", **headers)
        return response.status_code, response.json()

    status, _ = call("post", "/api/v1/slos", {"name": "seeded", "sli": "ttft_ms", "threshold_ms": 500,
                                              "objective": "99%"})
    assert status == 201
    document = Client().get("/api/v1/openapi.json", **headers).json()
    schema = document["components"]["schemas"]["EngineModelErrorSlo"]["properties"]
    assert schema["include_cached"]["const"] is False and schema["include_cached"]["type"] == "boolean"
    for cached in (0, 0.0, "false", None, True):
        status, refused = call("put", "/api/v1/slos/seeded", {**DEFINITION, "name": "renamed", "include_cached": cached})
        assert status == 400, (cached, refused)
        assert [p["field"] for p in refused["problems"]] == ["include_cached"], refused
        status, refused = call("post", "/api/v1/slos", {**DEFINITION, "include_cached": cached})
        assert status == 400, (cached, refused)
    assert list(SLO.objects.filter(project=project).values_list("name", "sli")) == [("seeded", "ttft_ms")]

    status, replaced = call("put", "/api/v1/slos/seeded", {**DEFINITION, "name": None, "include_cached": False,
                                                          "filters": {"replica_group": None}})
    assert status == 200, replaced
    assert replaced["name"] == "seeded" and replaced["sli"] == "engine_model_error" and replaced["filters"] == {}
    status, replaced = call("put", "/api/v1/slos/seeded", {"name": None, "sli": "ttft_ms", "threshold_ms": 500,
                                                          "objective": "99%",
                                                          "filters": {"service": "chat", "model": None}})
    assert status == 200 and replaced["name"] == "seeded" and replaced["filters"] == {"service": ["chat"]}, replaced
    status, created = call("post", "/api/v1/slos", {**DEFINITION, "filters": {"replica_group": None}})
    assert status == 201 and created["filters"] == {}, created
