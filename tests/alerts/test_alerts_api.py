"""GET /api/v1/alerts, /alerts/{fingerprint}, GET/POST /api/v1/silences, GET/DELETE /silences/{id} through Django's
URL routing and views, with an owner (operator of alpha), a teammate (viewer of alpha) and an outsider (operator
of beta): nobody reads or changes another project's alerts or silences."""
from __future__ import annotations

import datetime as dt
import json

import pytest
from alerts import lifecycle
from alerts.models import Alert, Silence
from django.contrib.auth import get_user_model
from django.test import Client
from slo import burn, services
from tenancy.models import ApiToken, Membership, Project

T0 = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)).replace(second=0, microsecond=0)
LABELS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d")
PAGE = {label: burn.WindowCounts(1000, 200 if label in ("5m", "1h") else 0) for label in LABELS}


def token(username: str, project: Project, role: str) -> str:
    user, _ = get_user_model().objects.get_or_create(username=username)
    Membership.objects.create(user=user, project=project, role=role)
    return ApiToken.issue(user, role=role)[1]


@pytest.fixture
def world(db, store, settings):
    # batch-e2e stays pending: a page pending period (the default, 0, fires at the first evaluation)
    settings.ALERTS = {**settings.ALERTS, "PAGE_FOR_SECONDS": 50.0}
    alpha, beta = Project.objects.create(name="alpha"), Project.objects.create(name="beta")
    tokens = {"owner": token("alice", alpha, "operator"), "teammate": token("carol", alpha, "viewer"),
              "outsider": token("bob", beta, "operator")}
    slos = {}
    for project in (alpha, beta):
        slo = services.create(project.id, {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 200,
                                           "objective": "99%"})
        for at in (T0, T0 + dt.timedelta(minutes=1)):
            lifecycle.apply_evaluation(slo, burn.evaluate(
                slo_id=slo.id, at=at, objective=0.99, period=slo.period, tiers=slo.burn_tiers, counts=PAGE))
        slos[project.name] = slo
    other = services.create(alpha.id, {"name": "batch-e2e", "sli": "e2e_ms", "threshold_ms": 5000,
                                       "objective": "99%"})
    lifecycle.apply_evaluation(other, burn.evaluate(
        slo_id=other.id, at=T0, objective=0.99, period=other.period, tiers=other.burn_tiers, counts=PAGE))
    return {"tokens": tokens, "alpha": alpha, "beta": beta, "slos": slos}


def call(method: str, path: str, who: str | None, world, body=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {world['tokens'][who]}"} if who else {}
    client = Client()
    if body is not None:
        response = getattr(client, method.lower())(path, data=json.dumps(body), content_type="application/json",
                                                   **headers)
    else:
        response = getattr(client, method.lower())(path, **headers)
    return response.status_code, response.json()


def test_alerts_list_filters_and_tenancy(world):
    status, body = call("GET", "/api/v1/alerts", "owner", world)
    assert status == 200
    alerts = body["alerts"]
    assert [(a["slo"], a["state"]) for a in alerts] == [("chat-ttft", "firing"), ("batch-e2e", "pending")]
    first = alerts[0]
    assert first["project"] == "alpha" and first["severity"] == "page" and first["kind"] == "slo_burn"
    assert len(first["fingerprint"]) == 64 and first["labels"]["slo"] == "chat-ttft"
    assert first["fired_at"] and first["started_at"] and first["diagnosis"] is not None
    assert "transitions" not in first

    assert [a["slo"] for a in call("GET", "/api/v1/alerts?state=pending", "teammate", world)[1]["alerts"]] == [
        "batch-e2e"]
    assert call("GET", "/api/v1/alerts?slo=chat-ttft&severity=page", "owner", world)[1]["alerts"][0]["state"] == (
        "firing")
    assert call("GET", "/api/v1/alerts?severity=ticket", "owner", world)[1]["alerts"] == []
    status, body = call("GET", "/api/v1/alerts?state=burning", "owner", world)
    assert status == 400 and "state: a comma-separated subset of pending" in body["error"]
    assert call("GET", "/api/v1/alerts?limit=0", "owner", world)[0] == 400

    # The outsider sees only beta's alert, and none of alpha's, whatever it asks.
    status, body = call("GET", "/api/v1/alerts", "outsider", world)
    assert status == 200 and [a["project"] for a in body["alerts"]] == ["beta"]
    assert call("GET", "/api/v1/alerts?project=alpha", "outsider", world)[0] == 404
    assert call("GET", "/api/v1/alerts", None, world)[0] == 401


def test_alert_detail_with_transitions_and_tenancy(world):
    alpha_alert = Alert.objects.get(slo=world["slos"]["alpha"], severity="page")
    status, body = call("GET", f"/api/v1/alerts/{alpha_alert.fingerprint}", "teammate", world)
    assert status == 200
    transitions = body["alert"]["transitions"]
    assert [(t["from"], t["to"], t["notified"]) for t in transitions] == [(None, "pending", False),
                                                                          ("pending", "firing", True)]
    assert transitions[1]["event_id"] and transitions[1]["delivery_ids"] == [], "an event, but no channel"
    assert call("GET", f"/api/v1/alerts/{alpha_alert.fingerprint}", "outsider", world)[0] == 404
    assert call("GET", "/api/v1/alerts/not-a-fingerprint", "owner", world)[0] == 400  # the path's declared form
    assert call("GET", f"/api/v1/alerts/{'0' * 64}", "owner", world)[0] == 404


def test_silences_create_list_expire_and_roles(world):
    body = {"matchers": ['slo="chat-ttft"', {"name": "severity", "op": "=~", "value": "page|ticket"}],
            "duration": "2h", "comment": "deploying the new gateway"}
    status, answer = call("POST", "/api/v1/silences", "teammate", world, body)
    assert status == 403 and "operator" in answer["error"]
    assert call("POST", "/api/v1/silences?project=alpha", "outsider", world, body)[0] == 404
    status, answer = call("POST", "/api/v1/silences", "owner", world, {**body, "project": "alpha"})
    assert status == 400 and answer["problems"][0]["field"] == "project", answer  # the project is ?project=

    status, answer = call("POST", "/api/v1/silences", "owner", world, body)
    assert status == 201, answer
    created = answer["silence"]
    assert created["status"] == "active" and created["created_by"] == "alice" and created["project"] == "alpha"
    assert created["matchers"][0] == {"name": "slo", "op": "=", "value": "chat-ttft"}
    assert answer["silences_alerts"] == [Alert.objects.get(slo=world["slos"]["alpha"], severity="page").fingerprint]
    alert = call("GET", "/api/v1/alerts?slo=chat-ttft", "owner", world)[1]["alerts"][0]
    assert alert["silenced_by"] == [created["id"]]

    assert [s["id"] for s in call("GET", "/api/v1/silences", "teammate", world)[1]["silences"]] == [created["id"]]
    assert call("GET", "/api/v1/silences", "outsider", world)[1]["silences"] == []
    assert call("GET", f"/api/v1/silences/{created['id']}", "outsider", world)[0] == 404
    assert call("DELETE", f"/api/v1/silences/{created['id']}", "outsider", world)[0] == 404
    assert call("DELETE", f"/api/v1/silences/{created['id']}", "teammate", world)[0] == 403

    status, answer = call("DELETE", f"/api/v1/silences/{created['id']}", "owner", world)
    assert status == 200 and answer["silence"]["status"] == "expired" and answer["silence"]["expired_by"] == "alice"
    assert call("GET", "/api/v1/silences?status=active", "owner", world)[1]["silences"] == []
    assert call("GET", "/api/v1/alerts?slo=chat-ttft", "owner", world)[1]["alerts"][0]["silenced_by"] == []
    assert Silence.objects.get(pk=created["id"]).project_id == world["alpha"].id


@pytest.mark.parametrize("body, message", [
    ({"matchers": ['slo="x"'], "duration": "1h"}, "comment: required"),
    ({"matchers": [], "duration": "1h", "comment": "c"}, "matchers: a list of at least 1 item"),
    ({"matchers": ['team=~".*"'], "duration": "1h", "comment": "c"}, "silence every alert"),
    ({"matchers": ['slo=~"("'], "duration": "1h", "comment": "c"}, "invalid regular expression"),
    ({"matchers": ['slo="x"'], "comment": "c"}, "ends_at or duration is required"),
    ({"matchers": ['slo="x"'], "comment": "c", "duration": "forever"}, "duration: a duration"),
    ({"matchers": ['slo="x"'], "comment": "c", "duration": "100d"}, "duration: between 1s and 90d"),
    ({"matchers": ['slo="x"'], "comment": "c", "ends_at": "2001-01-01T00:00:00Z"}, "ends_at"),
    ({"matchers": ['slo="x"'], "comment": "c", "starts_at": "yesterday", "duration": "1h"}, "ISO 8601"),
    ({"matchers": ['slo="x"'], "comment": "c", "duration": "1h", "creator": "me"}, "unknown field"),
])
def test_silence_validation(world, body, message):
    status, answer = call("POST", "/api/v1/silences", "owner", world, body)
    assert status == 400 and message in answer["error"], answer


def test_methods_and_malformed_bodies(world):
    client = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {world['tokens']['owner']}"}
    assert client.put("/api/v1/silences", **auth).status_code == 405
    assert client.post("/api/v1/alerts", **auth).status_code == 405
    response = client.post("/api/v1/silences", data=b"[1, 2]", content_type="application/json", **auth)
    assert response.status_code == 400 and "JSON object" in response.json()["error"]
    response = client.put("/api/v1/silences", **auth)
    assert response["Allow"] == "GET, POST, HEAD" and "use GET, POST" in response.json()["error"]
    assert client.post("/api/v1/silences", data=b"{}", content_type="application/json").status_code == 401
    # the JSON body reader every endpoint shares (apikit.api.StrictJsonParser)
    for data, status, message in [
        (b"", 400, "it is empty"),
        (b" \n", 400, "it is empty"),
        (b"\xff\xfe{\x00}\x00", 400, "in UTF-8"),
        (b'{"comment": "\xe9"}', 400, "in UTF-8"),
        (b"[" * 5000 + b"]" * 5000, 400, "the body must be a JSON object"),
        (b'{"duration": NaN}', 400, "the body must be a JSON object"),
        (b'"text"', 400, "not a string"),
        (b"{" + b" " * 70_000 + b"}", 413, "limited to 65536 bytes"),
    ]:
        response = client.post("/api/v1/silences", data=data, content_type="application/json", **auth)
        assert (response.status_code, response["Content-Type"]) == (status, "application/json"), data[:20]
        assert message in response.json()["error"], (data[:20], response.json())


def test_openapi_document_describes_alerts_and_silences(db):
    document = Client().get("/api/v1/openapi.json").json()
    assert {"/api/v1/alerts", "/api/v1/alerts/{fingerprint}", "/api/v1/silences", "/api/v1/silences/{silence_id}"} \
        <= set(document["paths"])
    assert set(document["paths"]["/api/v1/silences/{silence_id}"]) == {"get", "delete"}
    schemas = document["components"]["schemas"]
    assert {"Alert", "AlertTransition", "Diagnosis", "Silence", "Matcher"} <= set(schemas)
    refs = json.dumps(document["paths"]) + json.dumps(schemas)
    for name in ("Alert", "AlertTransition", "Diagnosis", "Silence", "Matcher", "Error"):
        assert f"#/components/schemas/{name}" in refs
