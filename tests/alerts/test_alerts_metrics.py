"""SLO and alert metrics on /metrics, scraped through Django's test client after real evaluations
(slo.evaluation.evaluate_all) of real SLOs over request rows seeded in a scratch ClickHouse store: the per-SLO
gauges say what GET /api/v1/slos/{name} says, each project's SLOs carry its own label, the alert gauge and the
transition counters follow pending → firing → resolved, evaluation cycles are timed and their failures counted,
the per-SLO series are read with one query however many SLOs there are, can be turned off, and a database that
cannot be read leaves the rest of /metrics served."""
from __future__ import annotations

import datetime as dt

import pytest
from alerts_support import insert_touched, installed_store, parse_metrics, spread
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from slo import evaluation, services
from slo.models import SLO
from tenancy.models import ApiToken, Membership, Project
from traces.store import StoreUnavailable

UTC = dt.timezone.utc
MIN = dt.timedelta(minutes=1)
SLO_FAMILIES = ("observatory_slo_objective_ratio", "observatory_slo_error_budget_remaining_ratio",
                "observatory_slo_burn_rate", "observatory_slo_state",
                "observatory_slo_last_evaluation_timestamp_seconds")
TTFT = {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 200, "objective": "99%",
        "filters": {"service": ["chat"]}}


def scrape(client, token: str | None = None) -> dict[str, dict[frozenset, float]]:
    """/metrics; the per-SLO series come only with an API token, for its projects."""
    response = client.get("/metrics", **({"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}))
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    return parse_metrics(response.content.decode())


def series(samples: dict, name: str, **labels) -> dict[frozenset, float]:
    """The samples of ``name`` whose labels include ``labels``, keyed by their other labels."""
    wanted = frozenset(labels.items())
    return {key - wanted: v for key, v in samples.get(name, {}).items() if wanted <= key}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get(name, {}).get(frozenset(labels.items()), 0.0)


def increase(before: dict, after: dict, name: str) -> dict[tuple, float]:
    """How the samples of ``name`` grew from one scrape to the next: {sorted label items: increase}."""
    old = before.get(name, {})
    return {tuple(sorted(key)): v - old.get(key, 0.0) for key, v in after.get(name, {}).items() if v != old.get(key, 0.0)}


def viewer_token(*projects: Project) -> str:
    """A viewer's token reading these projects."""
    user = get_user_model().objects.create(username="viewer-" + "-".join(p.name for p in projects))
    for project in projects:
        Membership.objects.create(user=user, project=project, role="viewer")
    return ApiToken.issue(user, role="viewer")[1]


def api_status(client, token: str, name: str) -> dict:
    response = client.get(f"/api/v1/slos/{name}", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    return response.json()


def seed(store, project: Project, at: dt.datetime, good: int, slow: int, failed: int = 0) -> None:
    """Chat requests over the 4 minutes before `at`: `good` fast ones (TTFT 100 ms), `slow` ones (TTFT 300 ms)
    and, among the fast ones, `failed` that failed."""
    since, until = at - 4.5 * MIN, at - 0.5 * MIN
    rows = (spread(project.id, since, until, good - failed, seed=1, ttft=100.0)
            + spread(project.id, since, until, slow, seed=2, ttft=300.0))
    if failed:
        rows += spread(project.id, since, until, failed, seed=3, ttft=100.0, status="error")
    insert_touched(store, rows)


@pytest.fixture
def store():
    with installed_store() as scratch:
        yield scratch


@pytest.fixture
def tenants(transactional_db, store):
    """alpha burns its TTFT budget 20× (a page), beta the same SLO 5× (a ticket), over the minutes before NOW.
    Transactional: evaluate_all starts with close_old_connections(), which drops a connection left in a test's
    transaction (PostgreSQL); and alert transitions are counted once their claim commits."""
    now = dt.datetime.now(UTC)
    at = now.replace(microsecond=0)  # an evaluation's windows end on its second
    alpha, beta = Project.objects.create(name="alpha"), Project.objects.create(name="beta")
    for project in (alpha, beta):
        services.create(project.id, TTFT)
    services.create(alpha.id, {"name": "chat-errors", "sli": "error_ratio", "objective": "99.9%",
                               "filters": {"service": ["chat"]}})
    services.create(alpha.id, {**TTFT, "name": "retired", "enabled": False})
    seed(store, alpha, at, good=80, slow=20, failed=1)
    seed(store, beta, at, good=95, slow=5)
    return {"now": now, "alpha": alpha, "beta": beta}


def label_set(**items) -> frozenset:
    return frozenset(items.items())


def test_every_series_is_there_before_the_first_evaluation(client, db):
    samples = scrape(client)
    assert set(samples["observatory_alert_transitions_total"]) == {
        label_set(kind=k, severity=s, to=t) for k in ("slo_burn", "latency_regression", "engine_model_drift") for s in ("page", "ticket")
        for t in ("pending", "firing", "resolved", "inactive")}
    assert samples["observatory_alerts"] == {
        label_set(kind=k, severity=s, state=t): 0 for k in ("slo_burn", "latency_regression", "engine_model_drift") for s in ("page", "ticket")
        for t in ("pending", "firing")}
    assert set(samples["observatory_slo_evaluation_failures_total"]) == {
        label_set(reason="clickhouse_unavailable"), label_set(reason="error")}
    assert set(samples["observatory_slo_evaluation_skipped_total"]) == {label_set(reason="busy"), label_set(reason="not_owner")}
    assert frozenset() in samples["observatory_slo_evaluations_total"]
    assert frozenset() in samples["observatory_slo_evaluation_seconds_count"]


def test_slo_series_say_what_the_api_says_per_project(client, tenants, store):
    before = scrape(client)
    assert evaluation.evaluate_all(tenants["now"], store=store) == 3  # the disabled one is not evaluated
    alpha, beta = tenants["alpha"], tenants["beta"]
    services.create(alpha.id, {"name": "later", "sli": "e2e_ms", "threshold_ms": 1000, "objective": "95%"})
    tokens = {"alpha": viewer_token(alpha), "beta": viewer_token(beta)}
    samples = scrape(client, viewer_token(alpha, beta))
    # without a token, or with one project's, no other project's SLO is named
    assert not series(scrape(client), "observatory_slo_objective_ratio")
    assert {dict(k)["project"] for k in series(scrape(client, tokens["beta"]), "observatory_slo_objective_ratio")} \
        == {"beta"}

    answers = {(project, name): api_status(client, tokens[project], f"{name}?project={project}")
               for project, name in (("alpha", "chat-ttft"), ("alpha", "chat-errors"), ("alpha", "later"),
                                     ("beta", "chat-ttft"))}
    # one series per enabled SLO, labelled with its own project; the disabled one is left out
    assert {(dict(k)["project"], dict(k)["slo"], dict(k)["sli"])
            for k in series(samples, "observatory_slo_objective_ratio")} == {
        (p, n, answers[p, n]["sli"]) for p, n in answers}
    for (project, name), body in answers.items():
        status = body["status"]
        labels = {"project": project, "slo": name, "sli": body["sli"]}
        assert value(samples, "observatory_slo_objective_ratio", **labels) == body["objective"]
        state = series(samples, "observatory_slo_state", **labels)
        firing = status["firing"] or {}
        assert state == {frozenset({"state": status["state"], "firing_tier": firing.get("name", ""),
                                    "severity": firing.get("severity", "")}.items()): 1.0}
        rates = {dict(k)["window"]: v for k, v in series(samples, "observatory_slo_burn_rate", **labels).items()}
        assert rates == {w: pytest.approx(r) for w, r in status["burn_rates"].items() if r is not None}
        budget = series(samples, "observatory_slo_error_budget_remaining_ratio", **labels)
        evaluated = series(samples, "observatory_slo_last_evaluation_timestamp_seconds", **labels)
        if status["last_evaluated_at"] is None:  # created after the evaluation: its definition only
            assert status["state"] == "pending" and not rates and not budget and not evaluated
            continue
        assert budget == {frozenset(): pytest.approx(status["budget_remaining"])}
        at = dt.datetime.fromisoformat(status["last_evaluated_at"].replace("Z", "+00:00"))
        assert evaluated == {frozenset(): at.timestamp()}
        assert at == tenants["now"].replace(microsecond=0)

    # the figures themselves: alpha 20 slow of 100 at 99% (a 20× page), beta 5 of 100 (5×, a ticket), each
    # counting only its own project's rows although both SLOs have the same name, SLI and filters
    alpha_ttft = {"project": "alpha", "slo": "chat-ttft", "sli": "ttft_ms"}
    beta_ttft = {"project": "beta", "slo": "chat-ttft", "sli": "ttft_ms"}
    assert value(samples, "observatory_slo_burn_rate", **alpha_ttft, window="5m") == pytest.approx(20.0)
    assert value(samples, "observatory_slo_burn_rate", **beta_ttft, window="1h") == pytest.approx(5.0)
    assert value(samples, "observatory_slo_error_budget_remaining_ratio", **alpha_ttft) == pytest.approx(-19.0)
    assert series(samples, "observatory_slo_state", **alpha_ttft) == {
        frozenset({"state": "burning", "firing_tier": "page-1h", "severity": "page"}.items()): 1.0}
    assert series(samples, "observatory_slo_state", **beta_ttft) == {
        frozenset({"state": "burning", "firing_tier": "ticket-1d", "severity": "ticket"}.items()): 1.0}
    assert series(samples, "observatory_slo_state", project="alpha", slo="chat-errors") == {
        frozenset({"sli": "error_ratio", "state": "low_traffic", "firing_tier": "", "severity": ""}.items()): 1.0}
    assert "retired" not in {dict(k).get("slo") for family in samples.values() for k in family}

    # the cycle was timed and counted in this process
    assert increase(before, samples, "observatory_slo_evaluations_total") == {(): 1}
    assert increase(before, samples, "observatory_slo_evaluation_seconds_count") == {(): 1}
    assert increase(before, samples, "observatory_slo_evaluation_failures_total") == {}


def test_alert_gauge_and_transition_counters_follow_real_evaluations(client, tenants, store, settings):
    settings.ALERTS = {**settings.ALERTS, "PAGE_FOR_SECONDS": 50.0, "TICKET_FOR_SECONDS": 290.0}
    now = tenants["now"]
    reader = viewer_token(tenants["alpha"], tenants["beta"])
    scrapes = [scrape(client, reader)]
    # pending: alpha's page (20×) and its ticket (the 1d tier burns under the page), beta's ticket (5×)
    # firing: the page, a minute later; the tickets wait for their 290 s
    # resolved: seven hours later nothing is left in any short window: the page resolves, the tickets never fired
    for at in (now, now + MIN, now + dt.timedelta(hours=7)):
        evaluation.evaluate_all(at, store=store)
        scrapes.append(scrape(client, reader))

    transitions = [increase(a, b, "observatory_alert_transitions_total") for a, b in zip(scrapes, scrapes[1:])]
    slo_burn = (("kind", "slo_burn"),)
    assert transitions == [
        {(*slo_burn, ("severity", "page"), ("to", "pending")): 1, (*slo_burn, ("severity", "ticket"), ("to", "pending")): 2},
        {(*slo_burn, ("severity", "page"), ("to", "firing")): 1},
        {(*slo_burn, ("severity", "page"), ("to", "resolved")): 1,
         (*slo_burn, ("severity", "ticket"), ("to", "inactive")): 2},
    ]
    active = [{k: v for k, v in series(s, "observatory_alerts", kind="slo_burn").items() if v} for s in scrapes]
    assert active == [
        {},
        {frozenset({"severity": "page", "state": "pending"}.items()): 1,
         frozenset({"severity": "ticket", "state": "pending"}.items()): 2},
        {frozenset({"severity": "page", "state": "firing"}.items()): 1,
         frozenset({"severity": "ticket", "state": "pending"}.items()): 2},
        {},
    ]
    assert all(v == 0 for s in scrapes for v in series(s, "observatory_alerts", kind="latency_regression").values())
    assert increase(scrapes[0], scrapes[-1], "observatory_slo_evaluations_total") == {(): 3}
    # after the resolution: no data in the fastest tier's window, as the API says
    samples = scrapes[-1]
    assert set(series(samples, "observatory_slo_state", project="alpha", slo="chat-ttft")) == {
        frozenset({"sli": "ttft_ms", "state": "no_data", "firing_tier": "", "severity": ""}.items())}
    assert "5m" not in {dict(k)["window"] for k in series(samples, "observatory_slo_burn_rate", project="alpha")}


class _Unreachable:
    """A store whose every call fails the way an unreachable ClickHouse server does (or with `error`)."""

    def __init__(self, error: Exception):
        self.error = error

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise self.error
        return fail


def test_failed_cycles_and_skipped_ticks_are_counted(client, transactional_db, settings):
    from slo import tasks

    for name in ("alpha", "beta"):
        services.create(Project.objects.create(name=name).id, {**TTFT, "name": "errors", "sli": "error_ratio",
                                                               "threshold_ms": None})
    before = scrape(client)
    now = dt.datetime.now(UTC)
    assert evaluation.evaluate_all(now, store=_Unreachable(StoreUnavailable("connection refused"))) == 0
    assert evaluation.evaluate_all(now, store=_Unreachable(RuntimeError("a bug"))) == 0
    settings.EMBEDDED_MODE = True  # chdb, and this test process is not the platform that owns it
    assert tasks.evaluate_all_task.run() == 0
    settings.EMBEDDED_MODE = False
    with tasks._cycle:  # a cycle still running in this process
        assert tasks.evaluate_all_task.run() == 0
    after = scrape(client)
    # once per reason and cycle, however many projects were skipped
    assert increase(before, after, "observatory_slo_evaluation_failures_total") == {
        (("reason", "clickhouse_unavailable"),): 1, (("reason", "error"),): 1}
    assert increase(before, after, "observatory_slo_evaluations_total") == {(): 2}
    assert increase(before, after, "observatory_slo_evaluation_skipped_total") == {
        (("reason", "not_owner"),): 1, (("reason", "busy"),): 1}
    # nothing was recorded: the SLOs are still pending
    assert set(SLO.objects.values_list("last_state", flat=True)) == {""}


def test_per_slo_series_are_read_with_one_query_however_many_slos(client, db):
    reader = get_user_model().objects.create(username="reader")

    def slo_queries() -> list[str]:
        for project in Project.objects.all():
            Membership.objects.get_or_create(user=reader, project=project, defaults={"role": "viewer"})
        token = ApiToken.issue(reader, role="viewer")[1]
        with CaptureQueriesContext(connection) as captured:
            samples = scrape(client, token)
        queries = [q["sql"] for q in captured.captured_queries]
        return samples, [sql for sql in queries if "slo_slo" in sql], [sql for sql in queries if "alerts_alert" in sql]

    alpha = Project.objects.create(name="alpha")
    services.create(alpha.id, TTFT)
    samples, few, alert_queries = slo_queries()
    assert len(series(samples, "observatory_slo_objective_ratio")) == 1
    for i in range(12):
        project = Project.objects.create(name=f"team-{i}")
        services.create(project.id, {**TTFT, "name": f"slo-{i}"})
        SLO.objects.filter(project=project).update(
            last_state="ok", last_evaluated_at=dt.datetime.now(UTC),
            last_status={"burn_rates": {"5m": 0.5, "1h": 0.25}, "budget_remaining": 0.9, "firing": None})
    samples, many, alert_queries_then = slo_queries()
    assert len(series(samples, "observatory_slo_objective_ratio")) == 13
    assert len(series(samples, "observatory_slo_burn_rate", window="1h")) == 12
    assert len(few) == len(many) == 1, many
    assert len(alert_queries) == len(alert_queries_then) == 1, alert_queries_then


def test_the_per_slo_series_can_be_turned_off(client, db, settings):
    services.create(Project.objects.create(name="secret-team").id, {**TTFT, "name": "secret-slo"})
    settings.OBSERVATORY_METRICS_SLO_SERIES = False
    token = viewer_token(Project.objects.get(name="secret-team"))
    with CaptureQueriesContext(connection) as captured:
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    text = response.content.decode()
    assert response.status_code == 200 and "secret" not in text
    assert not any(f"{name}{{" in text or f"{name} " in text for name in SLO_FAMILIES)
    assert not any("slo_slo" in q["sql"] for q in captured.captured_queries)
    # what names no project stays
    assert "observatory_alerts{" in text and "observatory_slo_evaluations_total" in text


def test_metrics_are_served_when_the_database_cannot_be_read(client, caplog):
    """No database access in this test (pytest-django refuses it): the scrape-time families are left out."""
    samples = scrape(client)
    names = set(samples)
    assert not names & set(SLO_FAMILIES) and "observatory_alerts" not in names
    assert {"observatory_spool_pending_bytes", "observatory_slo_evaluations_total",
            "observatory_alert_transitions_total"} <= names
    assert "alert metrics unavailable" in caplog.text  # (the per-SLO series need a token, read from the database)
