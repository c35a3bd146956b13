"""The Django admin's SLO form applies the same validation as the YAML and the API."""
from __future__ import annotations

import pytest
from django.contrib import admin
from slo.admin import SloForm
from slo.models import SLO
from tenancy.models import Project


@pytest.fixture
def project(db):
    return Project.objects.create(name="alpha")


def form_data(project, **overrides):
    data = {"project": project.id, "name": "chat-ttft", "description": "", "sli": "ttft_ms", "threshold_ms": "500",
            "objective": "0.99", "period_days": "30", "filters": '{"service": "chat-app"}', "tiers": "[]",
            "min_requests": "20", "min_bad": "3", "no_data": "ok", "repeat_interval_seconds": "14400",
            "labels": "{}", "enabled": "on"}
    data.update(overrides)
    return data


def test_admin_registers_slos():
    assert isinstance(admin.site._registry[SLO].form(), SloForm)


def test_a_valid_form_saves_normalised_fields(project):
    form = SloForm(data=form_data(project))
    assert form.is_valid(), form.errors
    slo = form.save()
    assert slo.filters == {"service": ["chat-app"]} and slo.tiers == [] and slo.objective == 0.99


def test_the_90_percent_slo_is_refused_in_the_admin_too(project):
    form = SloForm(data=form_data(project, objective="0.9"))
    assert not form.is_valid()
    [message] = form.non_field_errors()
    assert "tier page-1h (14.4× over 1h" in message and "can never fire" in message


def test_other_admin_errors(project):
    form = SloForm(data=form_data(project, sli="error_ratio", period_days="7", filters='{"region": "eu"}'))
    assert not form.is_valid()
    errors = " | ".join(form.non_field_errors())
    assert "error_ratio counts failed requests and takes no threshold" in errors
    assert "period must be 28d or 30d" in errors and "unknown key 'region'" in errors
