"""Payload shapes per channel kind from the neutral alert event: generic JSON, Alertmanager v4 (the exact fields its
webhook receivers read), Slack incoming webhooks, PagerDuty Events API v2; and what each kind receives over HTTP."""
from __future__ import annotations

import json

import pytest
from notify import renderers, services, signing
from notify.models import Channel
from notify_receivers import Receiver
from tenancy.models import Project

DIAGNOSIS = {
    "summary": "queue time rose: p50 40 → 900 ms; top engine_config baseline-v2 (92% of bad events). "
               "Queue-dominated: raise max_num_seqs (now 2) or add replicas.",
    "components": {"network": {"delta_ms": 1.0}, "overhead": {"delta_ms": 0.5}, "queue": {"delta_ms": 860.0},
                   "prefill": {"delta_ms": 12.0}, "decode": {"delta_ms": None}},
    "dominant_component": "queue",
    "top_contributors": [{"dimension": "engine_config", "value": "baseline-v2", "bad_share": 0.92},
                         {"dimension": "model", "value": "llama-3.1-8b"},
                         {"dimension": "prompt_bucket", "value": "<1k"},
                         {"dimension": "replica_group", "value": "canary"}],
    "suggestion": "Queue-dominated: raise max_num_seqs (now 2) or add replicas.",
}


def firing_event(**overrides) -> dict:
    event = {
        "event_id": "0b6c7d2e-1111-4a4a-9999-000000000001",
        "fingerprint": "3f2a9c",
        "status": "firing",
        "severity": "page",
        "kind": "slo_burn",
        "project": "alpha",
        "title": "SLO chat-ttft burning 15.2× its error budget (1h/5m)",
        "summary": "TTFT ≤ 200 ms for 99% of requests: 15% of requests too slow over the last hour",
        "description": "Budget burning fast.",
        "labels": {"alertname": "SLOBurnRate", "slo": "chat-ttft", "project": "alpha", "severity": "page",
                   "service": "chat", "model": "llama-3.1-8b"},
        "annotations": {"runbook_url": "https://runbooks.example/slo"},
        "starts_at": "2026-11-20T10:00:00Z",
        "ends_at": None,
        "url": "http://observatory.example/api/v1/alerts/3f2a9c",
        "slo": {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 200, "objective": 0.99, "period_days": 28,
                "burn_rates": {"5m": 16.0, "1h": 15.2}, "budget_remaining": 0.83},
        "diagnosis": DIAGNOSIS,
    }
    event.update(overrides)
    return event


def test_generic_webhook_is_the_versioned_event():
    event = firing_event()
    assert renderers.render_webhook(event) == {"version": "1", **event}


def test_alertmanager_v4_fields_exactly():
    body = renderers.render_alertmanager(firing_event(), "oncall", "http://observatory.example")
    assert set(body) == {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels",
                         "commonLabels", "commonAnnotations", "externalURL", "alerts"}
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "oncall"
    assert body["truncatedAlerts"] == 0 and body["externalURL"] == "http://observatory.example"
    assert body["groupLabels"] == {"alertname": "SLOBurnRate"}
    assert body["groupKey"] == '{}:{alertname="SLOBurnRate"}'
    [alert] = body["alerts"]
    assert set(alert) == {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}
    assert alert["status"] == "firing" and alert["fingerprint"] == "3f2a9c"
    assert alert["startsAt"] == "2026-11-20T10:00:00Z" and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["generatorURL"] == "http://observatory.example/api/v1/alerts/3f2a9c"
    assert alert["labels"] == body["commonLabels"] and alert["labels"]["slo"] == "chat-ttft"
    # Alertmanager labels and annotations are string → string
    assert all(isinstance(v, str) for v in {**alert["labels"], **alert["annotations"]}.values())
    assert alert["annotations"]["summary"].startswith("TTFT ≤ 200 ms")
    assert alert["annotations"]["suggestion"].startswith("Queue-dominated")
    assert alert["annotations"]["runbook_url"] == "https://runbooks.example/slo"


def test_alertmanager_resolved_carries_ends_at():
    body = renderers.render_alertmanager(firing_event(status="resolved", ends_at="2026-11-20T11:00:00Z"), "r", "")
    assert body["status"] == "resolved" and body["alerts"][0]["status"] == "resolved"
    assert body["alerts"][0]["endsAt"] == "2026-11-20T11:00:00Z"


def test_slack_text_and_blocks_with_the_diagnosis():
    body = renderers.render_slack(firing_event())
    assert body["text"].startswith(":rotating_light: [FIRING] SLO chat-ttft burning")
    types = [b["type"] for b in body["blocks"]]
    assert types == ["header", "section", "section", "section", "context"]
    fields = " ".join(f["text"] for f in body["blocks"][2]["fields"])
    assert "*Severity:* page" in fields and "*SLO:* chat-ttft" in fields and "83.0%" in fields and "15.2×" in fields
    diagnosis = body["blocks"][3]["text"]["text"]
    assert diagnosis.startswith("*Diagnosis*") and "queue +860 ms" in diagnosis and "max_num_seqs" in diagnosis
    assert "engine_config=baseline-v2" in diagnosis and "replica_group=canary" in diagnosis
    unknown_group = firing_event()
    unknown_group["diagnosis"] = {**DIAGNOSIS, "top_contributors": [
        *DIAGNOSIS["top_contributors"][:3], {"dimension": "replica_group", "value": ""}]}
    assert "replica_group" not in renderers.render_slack(unknown_group)["blocks"][3]["text"]["text"]
    assert diagnosis.count("raise max_num_seqs") == 1  # the suggestion is in the summary already
    assert "3f2a9c" in body["blocks"][4]["elements"][0]["text"]


def test_slack_respects_block_limits_and_resolved_icon():
    body = renderers.render_slack(firing_event(status="resolved", title="x" * 500, summary="y" * 5000, diagnosis=None))
    assert body["text"].startswith(":white_check_mark: [RESOLVED]")
    assert len(body["blocks"][0]["text"]["text"]) <= 150
    assert len(body["blocks"][1]["text"]["text"]) <= 3000
    assert "Diagnosis" not in json.dumps(body)


def test_pagerduty_trigger_and_resolve():
    body = renderers.render_pagerduty(firing_event(title="t" * 2000), "R0UTINGKEY123456", "http://obs.example")
    assert body["routing_key"] == "R0UTINGKEY123456" and body["event_action"] == "trigger"
    assert body["dedup_key"] == "3f2a9c"
    payload = body["payload"]
    assert len(payload["summary"]) == 1024 and payload["severity"] == "critical"
    assert payload["source"] == "chat" and payload["group"] == "alpha" and payload["class"] == "slo_burn"
    assert payload["timestamp"] == "2026-11-20T10:00:00Z"
    assert payload["custom_details"]["diagnosis"]["dominant_component"] == "queue"
    assert body["links"] == [{"href": "http://observatory.example/api/v1/alerts/3f2a9c",
                              "text": "Alert in the observatory"}]
    ticket = renderers.render_pagerduty(firing_event(severity="ticket"), "R0UTINGKEY123456", "")
    assert ticket["payload"]["severity"] == "warning"
    resolve = renderers.render_pagerduty(firing_event(status="resolved"), "R0UTINGKEY123456", "")
    assert resolve == {"routing_key": "R0UTINGKEY123456", "event_action": "resolve", "dedup_key": "3f2a9c"}


@pytest.mark.django_db
def test_each_kind_over_http(settings):
    settings.NOTIFY = {**settings.NOTIFY, "ALLOW_PRIVATE_DESTINATIONS": ["127.0.0.1:1024-65535"],
                       "EXTERNAL_URL": "http://observatory.example"}
    project = Project.objects.create(name="alpha")
    secret = signing.generate_secret()
    with Receiver() as receiver:
        for kind in ("webhook", "alertmanager", "slack", "pagerduty"):
            Channel.objects.create(project=project, name=kind, kind=kind, url=receiver.url + "/" + kind,
                                   secrets=[secret] if kind in ("webhook", "alertmanager") else [],
                                   routing_key="R0UTINGKEY123456" if kind == "pagerduty" else "")
        assert len(services.enqueue(project.id, firing_event(), severity="page")) == 4
        assert services.deliver_due() == 4
    by_path = {r.path.rsplit("/", 1)[1]: r for r in receiver.requests}
    assert set(by_path) == {"webhook", "alertmanager", "slack", "pagerduty"}
    for kind, received in by_path.items():
        assert received.headers["content-type"] == "application/json"
        assert received.headers["webhook-id"].startswith("msg_")  # the idempotency key, for every kind
        assert received.headers["user-agent"].startswith("llm-latency-observatory")
        signed = kind in ("webhook", "alertmanager")
        assert ("webhook-signature" in received.headers) == signed
        if signed:
            assert signing.verify(received.body, received.headers, secret)
    assert json.loads(by_path["webhook"].body)["version"] == "1"
    alertmanager = json.loads(by_path["alertmanager"].body)
    assert alertmanager["version"] == "4" and alertmanager["receiver"] == "alertmanager"
    assert alertmanager["externalURL"] == "http://observatory.example"
    assert "blocks" in json.loads(by_path["slack"].body)
    assert json.loads(by_path["pagerduty"].body)["dedup_key"] == "3f2a9c"
