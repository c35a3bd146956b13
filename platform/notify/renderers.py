"""Turning the neutral alert event into each channel kind's request body: generic JSON, Alertmanager v4 webhook,
Slack incoming webhook, PagerDuty Events API v2. Pure functions of (event, channel settings)."""
from __future__ import annotations

import json

# Alertmanager sends this as endsAt of a firing alert (Go's zero time).
ZERO_TIME = "0001-01-01T00:00:00Z"
PAGERDUTY_SEVERITY = {"page": "critical", "ticket": "warning", "info": "info"}
_SLACK_SECTION_LIMIT = 3000
_SLACK_HEADER_LIMIT = 150


def encode(document: dict) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8")


def _clip(text: str, limit: int) -> str:
    text = str(text or "")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _labels(event: dict) -> dict[str, str]:
    return {str(k): str(v) for k, v in (event.get("labels") or {}).items() if v is not None}


def _annotations(event: dict) -> dict[str, str]:
    annotations = {str(k): str(v) for k, v in (event.get("annotations") or {}).items() if v is not None}
    for key in ("summary", "description"):
        if event.get(key) and key not in annotations:
            annotations[key] = str(event[key])
    suggestion = (event.get("diagnosis") or {}).get("suggestion")
    if suggestion and "suggestion" not in annotations:
        annotations["suggestion"] = suggestion if isinstance(suggestion, str) else json.dumps(suggestion)
    return annotations


def render_webhook(event: dict) -> dict:
    """The event itself, versioned."""
    return {"version": "1", **event}


def render_alertmanager(event: dict, receiver: str, external_url: str) -> dict:
    """Alertmanager's webhook_config body (version 4), one alert per notification, so existing receivers work."""
    labels = _labels(event)
    annotations = _annotations(event)
    group_labels = {"alertname": labels["alertname"]} if "alertname" in labels else {}
    group_key = "{}:{" + ", ".join(f'{k}="{v}"' for k, v in sorted(group_labels.items())) + "}"
    status = event.get("status", "firing")
    return {
        "version": "4",
        "groupKey": group_key,
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": external_url,
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": annotations,
                "startsAt": event.get("starts_at") or ZERO_TIME,
                "endsAt": (event.get("ends_at") or ZERO_TIME) if status == "resolved" else ZERO_TIME,
                "generatorURL": event.get("url") or "",
                "fingerprint": event.get("fingerprint", ""),
            }
        ],
    }


def _diagnosis_lines(diagnosis: dict | None) -> list[str]:
    if not diagnosis:
        return []
    lines = []
    if diagnosis.get("summary"):
        lines.append(str(diagnosis["summary"]))
    components = diagnosis.get("components")
    if isinstance(components, dict):
        parts = []
        for name, change in components.items():
            if isinstance(change, dict) and change.get("delta_ms") is not None:
                parts.append(f"{name} {change['delta_ms']:+.0f} ms")
        if parts:
            lines.append("Components vs baseline: " + ", ".join(parts))
    dominant = diagnosis.get("dominant_component")
    if dominant:
        lines.append(f"Dominant component: *{dominant}*")
    contributors = diagnosis.get("top_contributors")
    if isinstance(contributors, list) and contributors:
        shown = []
        for c in contributors[:6]:  # one per dimension: model, prompt bucket, engine config, replica group
            if isinstance(c, dict) and c.get("value") not in ("", None):  # '' = not known
                shown.append(f"{c.get('dimension', '?')}={c.get('value', '?')}")
        if shown:
            lines.append("Top contributors: " + ", ".join(shown))
    suggestion = diagnosis.get("suggestion")
    if suggestion:
        text = suggestion if isinstance(suggestion, str) else json.dumps(suggestion)
        if text not in str(diagnosis.get("summary") or ""):
            lines.append(f"Suggestion: {text}")
    return lines


def render_slack(event: dict) -> dict:
    """An incoming-webhook message: ``text`` (the notification fallback) and Block Kit blocks."""
    status = event.get("status", "firing")
    icon = ":white_check_mark:" if status == "resolved" else (
        ":rotating_light:" if event.get("severity") == "page" else ":warning:")
    title = event.get("title") or event.get("labels", {}).get("alertname") or "alert"
    text = f"{icon} [{status.upper()}] {title}"
    fields = [f"*Severity:* {event.get('severity', '?')}", f"*Project:* {event.get('project', '?')}"]
    slo = event.get("slo") or {}
    if slo.get("name"):
        fields.append(f"*SLO:* {slo['name']}")
    if slo.get("budget_remaining") is not None:
        try:
            fields.append(f"*Budget left:* {float(slo['budget_remaining']) * 100:.1f}%")
        except (TypeError, ValueError):
            pass
    burn = slo.get("burn_rates") or {}
    if isinstance(burn, dict) and burn:
        rates = ", ".join(f"{w} {r:.1f}×" for w, r in burn.items() if isinstance(r, (int, float)))
        if rates:
            fields.append(f"*Burn rate:* {rates}")
    blocks = [
        {"type": "header", "text": {"type": "plain_text", "text": _clip(f"[{status.upper()}] {title}",
                                                                       _SLACK_HEADER_LIMIT)}},
        {"type": "section", "text": {"type": "mrkdwn", "text": _clip(event.get("summary") or title,
                                                                     _SLACK_SECTION_LIMIT)}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": _clip(f, 2000)} for f in fields[:10]]},
    ]
    diagnosis = _diagnosis_lines(event.get("diagnosis"))
    if diagnosis:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": _clip(
            "*Diagnosis*\n" + "\n".join(diagnosis), _SLACK_SECTION_LIMIT)}})
    context = f"fingerprint `{event.get('fingerprint', '')}`"
    if event.get("url"):
        context += f" · <{event['url']}|open in the observatory>"
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": _clip(context, 2000)}]})
    return {"text": text, "blocks": blocks}


def render_pagerduty(event: dict, routing_key: str, external_url: str) -> dict:
    """Events API v2: trigger or resolve, deduplicated on the alert's fingerprint."""
    action = "resolve" if event.get("status") == "resolved" else "trigger"
    labels = _labels(event)
    document = {
        "routing_key": routing_key,
        "event_action": action,
        "dedup_key": _clip(event.get("fingerprint") or event.get("event_id", ""), 255),
    }
    if action == "trigger":
        source = labels.get("service") or event.get("project") or "llm-latency-observatory"
        document["payload"] = {
            "summary": _clip(event.get("title") or event.get("summary") or "alert", 1024),
            "source": source,
            "severity": PAGERDUTY_SEVERITY.get(event.get("severity", ""), "warning"),
            "timestamp": event.get("starts_at"),
            "component": labels.get("model") or labels.get("slo") or None,
            "group": event.get("project"),
            "class": event.get("kind"),
            "custom_details": {
                "summary": event.get("summary"),
                "description": event.get("description"),
                "labels": labels,
                "slo": event.get("slo"),
                "diagnosis": event.get("diagnosis"),
                "event_id": event.get("event_id"),
            },
        }
        document["payload"] = {k: v for k, v in document["payload"].items() if v is not None}
        document["client"] = "LLM latency observatory"
        document["client_url"] = external_url
        if event.get("url"):
            document["links"] = [{"href": event["url"], "text": "Alert in the observatory"}]
    return document


def render(kind: str, event: dict, *, receiver: str, routing_key: str = "", external_url: str = "") -> dict:
    if kind == "webhook":
        return render_webhook(event)
    if kind == "alertmanager":
        return render_alertmanager(event, receiver, external_url)
    if kind == "slack":
        return render_slack(event)
    if kind == "pagerduty":
        return render_pagerduty(event, routing_key, external_url)
    raise ValueError(f"unknown channel kind {kind!r}")
