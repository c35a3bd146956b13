"""The Django admin for channels and deliveries: pages render, secrets are never shown, a generated one is shown
once on creation."""
from __future__ import annotations

import pytest
from notify import services
from notify.models import Channel
from tenancy.models import Project

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.mark.django_db
def test_admin_pages_hide_secrets(admin_client):
    project = Project.objects.create(name="alpha")
    channel = Channel.objects.create(project=project, name="hook", kind="webhook", url="https://e.com/h?token=abc",
                                     secrets=[SECRET])
    [delivery_id] = services.enqueue(project.id, {"event_id": "e", "fingerprint": "f", "status": "firing"},
                                     severity="page")
    for url in ("/admin/notify/channel/", f"/admin/notify/channel/{channel.id}/change/",
                "/admin/notify/delivery/", f"/admin/notify/delivery/{delivery_id}/change/"):
        response = admin_client.get(url)
        assert response.status_code == 200, url
        assert SECRET not in response.content.decode(), url
    # the list shows URLs redacted (the change form edits the URL, so it shows it there)
    assert "token=abc" not in admin_client.get("/admin/notify/channel/").content.decode()


@pytest.mark.django_db
def test_admin_generates_a_secret_for_a_signed_channel(admin_client):
    project = Project.objects.create(name="alpha")
    response = admin_client.post("/admin/notify/channel/add/", {
        "project": project.id, "name": "new", "kind": "alertmanager", "url": "https://am.example/hook",
        "routing_key": "", "severities": "[]", "matchers": "[]", "send_resolved": "on", "enabled": "on",
        "disabled_reason": "", "created_at_0": "2026-11-20", "created_at_1": "10:00:00",
    }, follow=True)
    assert response.status_code == 200
    channel = Channel.objects.get(name="new")
    [secret] = channel.secrets
    assert secret.startswith("whsec_") and secret in response.content.decode()  # shown once, in the message
