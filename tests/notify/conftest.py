"""Fixtures of the delivery tests (their receivers and helpers are in notify_receivers.py)."""
from __future__ import annotations

import pytest


@pytest.fixture
def project():
    from tenancy.models import Project

    return Project.objects.create(name="alpha")


@pytest.fixture
def local_receivers(settings):
    """Let deliveries reach the tests' receivers on 127.0.0.1, which the SSRF rules refuse otherwise."""
    settings.NOTIFY = {**settings.NOTIFY, "ALLOW_PRIVATE_DESTINATIONS": ["127.0.0.1:1024-65535"], "READ_TIMEOUT_SECONDS": 2.0}
