"""The channels API on a live platform: admins manage, viewers read, other projects see nothing; secrets shown once;
rotation; test sends to a real receiver; the delivery log; validation messages."""
from __future__ import annotations

import http.client
import json
import time

import pytest
from notify import signing
from notify_receivers import Receiver, Reply
from otlp_payloads import metric_total


@pytest.fixture(scope="module")
def platform(request):
    """The module's live platform (projects alpha and beta), allowed to reach receivers on 127.0.0.1, with
    carol admin of alpha, dave operator of alpha, erin admin of beta (alice: viewer of alpha, bob: viewer of beta)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("NOTIFY_ALLOW_PRIVATE_DESTINATIONS", "127.0.0.1:1024-65535")
    patch.setenv("NOTIFY_DELIVER_INTERVAL_SECONDS", "1")  # the platform's beat sends notify.deliver_due each second
    patch.setenv("NOTIFY_BACKOFF_BASE_SECONDS", "1")
    try:
        live = request.getfixturevalue("live_platform")
        manage = live.process.manage
        live.tokens["carol"] = manage("create_api_token", "--user", "carol", "--role", "admin", "--project", "alpha")
        live.tokens["dave"] = manage("create_api_token", "--user", "dave", "--role", "operator", "--project", "alpha")
        live.tokens["erin"] = manage("create_api_token", "--user", "erin", "--role", "admin", "--project", "beta")
        yield live
    finally:
        patch.undo()


def call(platform, method: str, path: str, token: str | None = None, body=None) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", platform.process.port, timeout=60)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    if response.status == 204:
        return 204, None
    assert response.getheader("Content-Type", "").startswith("application/json"), raw[:300]
    return response.status, json.loads(raw)


def create(platform, token="carol", project=None, **body):
    path = "/api/v1/channels" + (f"?project={project}" if project else "")
    return call(platform, "POST", path, platform.tokens[token], body)


def test_admins_create_viewers_read_outsiders_see_nothing(platform):
    status, body = create(platform, "alice", name="viewer-try", kind="webhook", url="https://example.com/hook")
    assert status == 403 and "admin role" in body["error"]
    status, body = create(platform, "dave", name="operator-try", kind="webhook", url="https://example.com/hook")
    assert status == 403
    status, body = create(platform, name="ops-hook", kind="webhook", url="https://example.com/hook?token=abc")
    assert status == 201, body
    channel = body["channel"]
    [secret] = body["secrets"]
    assert signing.validate_secret(secret) and channel["secret_hints"] == [secret[:10] + "…"]
    assert channel["url"] == "https://example.com/hook?token=***"  # query values are not shown back
    assert channel["project"] == "alpha" and channel["enabled"] and channel["kind"] == "webhook"
    path = f"/api/v1/channels/{channel['id']}"

    for who in ("alice", "carol", "dave"):
        status, listed = call(platform, "GET", "/api/v1/channels", platform.tokens[who])
        assert status == 200 and channel["id"] in [c["id"] for c in listed["channels"]]
        assert secret not in json.dumps(listed)  # shown once, never again
        status, one = call(platform, "GET", path, platform.tokens[who])
        assert status == 200 and one["channel"]["name"] == "ops-hook" and secret not in json.dumps(one)

    for outsider in ("bob", "erin"):
        status, listed = call(platform, "GET", "/api/v1/channels", platform.tokens[outsider])
        assert status == 200 and channel["id"] not in [c["id"] for c in listed["channels"]]
        assert call(platform, "GET", path, platform.tokens[outsider])[0] == 404
        assert call(platform, "GET", path + "/deliveries", platform.tokens[outsider])[0] == 404
        assert call(platform, "PATCH", path, platform.tokens[outsider], {"name": "stolen"})[0] == 404
        assert call(platform, "POST", path + "/test", platform.tokens[outsider])[0] == 404
        assert call(platform, "DELETE", path, platform.tokens[outsider])[0] == 404
    # a project the token cannot read, named explicitly
    assert create(platform, "erin", project="alpha", name="x", kind="webhook", url="https://e.com/")[0] == 404
    assert call(platform, "PATCH", path, platform.tokens["alice"], {"name": "viewer-edit"})[0] == 403
    assert call(platform, "DELETE", path, platform.tokens["dave"])[0] == 403
    assert call(platform, "GET", path)[0] == 401
    assert call(platform, "GET", path, "lot_not-a-token")[0] == 401
    assert call(platform, "PUT", path, platform.tokens["carol"], {})[0] == 405


@pytest.mark.parametrize("body, message", [
    ({"name": "a", "kind": "email", "url": "https://e.com/"}, "kind: one of 'webhook'"),
    ({"name": "a", "kind": "webhook", "url": "ftp://e.com/"}, "only http and https"),
    ({"name": "a", "kind": "webhook", "url": "http://10.0.0.1/hook"}, "10.0.0.1 is a private address"),
    ({"name": "a", "kind": "webhook", "url": "http://169.254.169.254/"}, "metadata"),
    ({"name": "a", "kind": "webhook"}, "url: required with webhook"),
    ({"kind": "webhook", "url": "https://e.com/"}, "name: required"),
    ({"name": "a", "kind": "webhook", "url": "https://e.com/", "colour": "red"}, "colour: not a field of webhook"),
    ({"name": "a", "kind": "pagerduty"}, "routing_key: required with pagerduty"),
    ({"name": "a", "kind": "slack", "url": "https://hooks.slack.com/services/T/B/X",
      "secrets": ["whsec_" + "A" * 32]}, "secrets: not a field of slack"),
    ({"name": "a", "kind": "webhook", "url": "https://e.com/", "secrets": ["plain"]}, "whsec_"),
    ({"name": "a", "kind": "webhook", "url": "https://e.com/", "severities": ["critical"]}, "severities"),
    ({"name": "a", "kind": "webhook", "url": "https://e.com/", "matchers": ['model=~"("']},
     "invalid regular expression"),
    ({"name": "a", "kind": "webhook", "url": "https://e.com/", "matchers": ["model ~ llama"]}, 'name="value"'),
    ({"name": "a", "kind": "webhook", "url": "https://e.com/", "send_resolved": "yes"}, "true or false"),
])
def test_validation_messages(platform, body, message):
    status, answer = create(platform, **body)
    assert status == 400 and message in answer["error"], answer


def test_malformed_bodies_and_duplicates(platform):
    token = platform.tokens["carol"]
    assert call(platform, "POST", "/api/v1/channels", token, b"{not json")[1]["error"] == \
        "the body must be a JSON object"
    assert call(platform, "POST", "/api/v1/channels", token, [1, 2])[0] == 400
    assert create(platform, name="dup", kind="webhook", url="https://e.com/")[0] == 201
    status, body = create(platform, name="dup", kind="webhook", url="https://e.com/")
    assert status == 409 and "already exists" in body["error"]


def test_kinds_matchers_and_redaction(platform):
    status, body = create(platform, name="slack-chat", kind="slack",
                          url="https://hooks.slack.com/services/T000/B000/not-a-real-token",
                          severities=["page"], matchers=['service=~"chat-.*"', {"name": "model", "op": "!=",
                                                                                 "value": "tiny"}])
    assert status == 201 and "secrets" not in body
    channel = body["channel"]
    assert channel["url"] == "https://hooks.slack.com/services/***" and "not-a-real-token" not in json.dumps(body)
    assert channel["matchers"] == [{"name": "service", "op": "=~", "value": "chat-.*"},
                                   {"name": "model", "op": "!=", "value": "tiny"}]
    status, body = create(platform, name="pd", kind="pagerduty", routing_key="R0UTINGKEY0123456789abcdef")
    assert status == 201 and body["channel"]["url"] == "https://events.pagerduty.com/v2/enqueue"
    assert body["channel"]["routing_key_hint"] == "R0UT…" and "0123456789abcdef" not in json.dumps(body)
    status, body = call(platform, "PATCH", f"/api/v1/channels/{channel['id']}", platform.tokens["carol"],
                        {"kind": "webhook"})
    assert status == 400 and "kind cannot be changed" in body["error"]


def test_test_send_rotation_and_delivery_log(platform):
    with Receiver([Reply(200), Reply(200), Reply(200), Reply(500, body=b"receiver broke")]) as receiver:
        status, body = create(platform, name="local", kind="webhook", url=receiver.url)
        assert status == 201
        first_secret = body["secrets"][0]
        path = f"/api/v1/channels/{body['channel']['id']}"
        carol = platform.tokens["carol"]

        status, sent = call(platform, "POST", path + "/test", carol)
        assert status == 200 and sent["delivery"]["status"] == "succeeded" and sent["delivery"]["is_test"]
        received = receiver.requests[0]
        assert signing.verify(received.body, received.headers, first_secret)
        assert received.headers["webhook-id"] == sent["delivery"]["webhook_id"]
        assert json.loads(received.body)["kind"] == "test"

        status, rotated = call(platform, "PATCH", path, carol, {"rotate_secret": True})
        assert status == 200 and len(rotated["channel"]["secret_hints"]) == 2
        second_secret = rotated["new_secret"]
        assert call(platform, "POST", path + "/test", carol)[1]["delivery"]["status"] == "succeeded"
        received = receiver.requests[1]
        assert received.headers["webhook-signature"].count("v1,") == 2
        assert signing.verify(received.body, received.headers, first_secret)
        assert signing.verify(received.body, received.headers, second_secret)

        status, retired = call(platform, "PATCH", path, carol, {"retire_secrets": True})
        assert status == 200 and retired["channel"]["secret_hints"] == [second_secret[:10] + "…"]
        assert "new_secret" not in retired
        call(platform, "POST", path + "/test", carol)
        received = receiver.requests[2]
        assert signing.verify(received.body, received.headers, second_secret)
        with pytest.raises(signing.WebhookVerificationError):
            signing.verify(received.body, received.headers, first_secret)

        status, failed = call(platform, "POST", path + "/test", carol)
        assert status == 200 and failed["delivery"]["status"] == "failed"
        assert failed["delivery"]["attempts"] == 1 and "HTTP 500: receiver broke" in failed["delivery"]["last_error"]

    # What the destination answered is for the project's admins (carol): a viewer (alice) sees the status only.
    status, log = call(platform, "GET", path + "/deliveries", carol)
    assert log["deliveries"][0]["log"][0]["response_excerpt"] == "receiver broke"
    assert "receiver broke" in log["deliveries"][0]["last_error"]
    status, log = call(platform, "GET", path + "/deliveries", platform.tokens["alice"])
    assert status == 200 and [d["status"] for d in log["deliveries"]] == ["failed", "succeeded", "succeeded",
                                                                          "succeeded"]
    assert "receiver broke" not in json.dumps(log), "a viewer read what the destination answered"
    assert log["deliveries"][0]["log"][0]["response_excerpt"] is None
    newest = log["deliveries"][0]
    assert newest["last_status_code"] == 500 and newest["last_duration_ms"] > 0 and newest["next_attempt_at"] is None
    assert [(a["attempt"], a["outcome"], a["status_code"]) for a in newest["log"]] == [(1, "transient", 500)]
    status, page = call(platform, "GET", path + "/deliveries?limit=2", platform.tokens["alice"])
    assert len(page["deliveries"]) == 2 and page["next_before"] == page["deliveries"][-1]["id"]
    status, rest = call(platform, "GET", path + f"/deliveries?limit=2&before={page['next_before']}",
                        platform.tokens["alice"])
    assert len(rest["deliveries"]) == 2 and rest["next_before"] is None
    status, only_failed = call(platform, "GET", path + "/deliveries?status=failed", platform.tokens["alice"])
    assert [d["id"] for d in only_failed["deliveries"]] == [newest["id"]]
    assert call(platform, "GET", path + "/deliveries?status=lost", platform.tokens["alice"])[0] == 400
    assert call(platform, "GET", path + "/deliveries?limit=0", platform.tokens["alice"])[0] == 400

    status, channel = call(platform, "GET", path, platform.tokens["alice"])
    assert "HTTP 500" in channel["channel"]["last_error"] and channel["channel"]["last_success_at"]
    assert "receiver broke" not in channel["channel"]["last_error"]
    assert "receiver broke" in call(platform, "GET", path, carol)[1]["channel"]["last_error"]


def test_disable_enable_and_delete(platform):
    status, body = create(platform, name="to-delete", kind="alertmanager", url="https://am.example/hook")
    path = f"/api/v1/channels/{body['channel']['id']}"
    carol = platform.tokens["carol"]
    status, body = call(platform, "PATCH", path, carol, {"enabled": False, "severities": ["ticket"]})
    assert status == 200 and not body["channel"]["enabled"]
    assert body["channel"]["disabled_reason"] == "disabled by carol" and body["channel"]["severities"] == ["ticket"]
    status, body = call(platform, "PATCH", path, carol, {"enabled": True})
    assert body["channel"]["enabled"] and body["channel"]["disabled_reason"] is None
    assert call(platform, "DELETE", path, carol) == (204, None)
    assert call(platform, "GET", path, carol)[0] == 404


def test_openapi_lists_the_channel_endpoints(platform):
    status, document = call(platform, "GET", "/api/v1/openapi.json")
    assert status == 200
    for route in ("/api/v1/channels", "/api/v1/channels/{channel_id}", "/api/v1/channels/{channel_id}/test",
                  "/api/v1/channels/{channel_id}/deliveries"):
        assert route in document["paths"]
    assert {"Channel", "Delivery", "DeliveryAttempt"} <= set(document["components"]["schemas"])


def test_the_platform_s_own_worker_and_beat_deliver_enqueued_events(platform):
    """What the alert lifecycle does (enqueue in the platform's database) reaches a receiver through the Celery
    worker and beat that runplatform runs, with no test driving deliver_due. Project beta: its only channel is
    this one, so the platform's delivery metrics count exactly this delivery."""
    with Receiver([Reply(503)]) as receiver:
        status, body = create(platform, "erin", project="beta", name="beat-driven", kind="webhook", url=receiver.url)
        assert status == 201
        secret = body["secrets"][0]
        script = (
            "from notify.services import enqueue; from tenancy.models import Project; "
            "print(enqueue(Project.objects.get(name='beta').id, {'event_id': 'beat-evt-1', 'fingerprint': 'beat-fp', "
            "'status': 'firing', 'title': 'from the lifecycle', 'labels': {'alertname': 'X'}}, severity='page'))"
        )
        platform.process.manage("shell", "-c", script)
        deadline = time.time() + 60
        while time.time() < deadline and not any(r.status == 200 for r in receiver.requests):
            time.sleep(0.2)
    assert [r.status for r in receiver.requests] == [503, 200], platform.process.log_tail()
    assert len({r.headers["webhook-id"] for r in receiver.requests}) == 1
    for received in receiver.requests:
        assert signing.verify(received.body, received.headers, secret)
        assert json.loads(received.body)["event_id"] == "beat-evt-1"
    status, log = call(platform, "GET", f"/api/v1/channels/{body['channel']['id']}/deliveries",
                       platform.tokens["bob"])
    [delivery] = log["deliveries"]
    assert delivery["status"] == "succeeded" and delivery["attempts"] == 2 and not delivery["is_test"]
    assert [a["outcome"] for a in delivery["log"]] == ["transient", "succeeded"]

    # the platform's /metrics counts what its own worker did (test sends of the other tests are left out)
    attempts, deliveries = "observatory_notify_delivery_attempts_total", "observatory_notify_deliveries_total"
    assert metric_total(platform, attempts, kind="webhook", outcome="transient") == 1
    assert metric_total(platform, attempts, kind="webhook", outcome="success") == 1
    assert metric_total(platform, deliveries, kind="webhook", outcome="succeeded") == 1
    assert metric_total(platform, deliveries, kind="webhook", outcome="failed") == 0
    assert metric_total(platform, "observatory_notify_delivery_attempt_seconds_count", kind="webhook") == 2
    assert metric_total(platform, "observatory_notify_backlog_deliveries", status="pending") == 0
