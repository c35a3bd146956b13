"""An engine model's drift as an alert, on the metadata database and notify's real enqueue: a model whose live error
passes the bound raises a pending alert that fires after its severity's period with a diagnosis naming the cost
that moved, one notification per transition; the error back under the bound resolves it; a study refuses the
drifted model with the live figures. (tests/tuning/test_calibration_live.py drives the same through a live group.)"""
from __future__ import annotations

import datetime as dt

import pytest
from alerts.models import Alert, AlertKind, AlertState
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from notify.models import Channel, Delivery
from tenancy.models import Membership, Project
from tuning import calibration, drift
from tuning.models import EngineModel, ModelState
from tuning.service import StudyError, engine_model_for

from engine.config import EngineConfig

CONFIG = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu_type="L4", max_model_len=4096)
FITS = {"ttft_ms_p50": 0.04, "tpot_ms_p50": -0.03, "ttft_ms_p95": 0.06, "tpot_ms_p95": 0.02}
# (predicted - observed) / observed: the model predicts a TPOT 38 % under what was served.
DRIFTED = {"ttft_ms_p50": -0.11, "tpot_ms_p50": -0.38, "ttft_ms_p95": -0.15, "tpot_ms_p95": -0.41,
           "prefill_ms_p50": -0.07, "prefill_ms_p95": -0.05}
# A saturated group's latest traffic: the queue, and the median TTFT with it, several-fold off the replay; the
# prefill time (TTFT less queue) and TPOT, what the model computes, within the bound.
SATURATED = {"ttft_ms_p50": -0.93, "tpot_ms_p50": -0.12, "ttft_ms_p95": -0.8, "tpot_ms_p95": -0.1,
             "queue_ms_p50": -0.97, "prefill_ms_p50": 0.06, "prefill_ms_p95": 0.09}
SLOWER_DECODE = {"decode": 0.37, "prefill": 0.08}


@pytest.fixture
def model(db, settings):
    settings.ALERTS = {**settings.ALERTS, "TICKET_FOR_SECONDS": 60.0}
    project = Project.objects.create(name="alpha")
    Channel.objects.create(project=project, name="hook", kind="webhook", url="http://127.0.0.1:9/hook")
    now = timezone.now()
    return EngineModel.objects.create(
        project=project, group="chat", config_version=CONFIG.version, config=CONFIG.to_dict(),
        window_start=now - dt.timedelta(hours=1), window_end=now, state=ModelState.FITTED, base_profile="L4",
        constants={"mfu": 0.4, "bandwidth_efficiency": 0.6}, start_constants={"mfu": 0.45, "bandwidth_efficiency": 0.7},
        held_out_error=FITS)


def test_a_drift_goes_pending_then_fires_naming_decode_and_resolves(model):
    t0 = timezone.now()
    assert drift.apply(model, FITS, {"decode": 0.02}, t0, drifting=False) == []  # fits: nothing
    [pending] = drift.apply(model, DRIFTED, SLOWER_DECODE, t0 + dt.timedelta(seconds=10), drifting=True)
    assert pending.to_state == AlertState.PENDING and not pending.notified
    assert drift.apply(model, DRIFTED, SLOWER_DECODE, t0 + dt.timedelta(seconds=40), drifting=True) == []
    [fired] = drift.apply(model, DRIFTED, SLOWER_DECODE, t0 + dt.timedelta(seconds=75), drifting=True)
    assert fired.to_state == AlertState.FIRING and fired.notified
    alert = Alert.objects.get()
    assert alert.kind == AlertKind.ENGINE_MODEL_DRIFT and alert.severity == "ticket"
    assert alert.labels == {"alertname": "EngineModelDrift", "project": "alpha", "severity": "ticket",
                            "group": "chat", "cost": "decode"}
    assert alert.diagnosis["dominant_component"] == "decode"
    assert alert.diagnosis["summary"] == "decode step time +37 % at the same batch sizes"
    assert alert.annotations["title"] == ("Engine model of chat drifts: live p50 TPOT 38% under what was served "
                                          "(bound 20%)")
    [delivery] = Delivery.objects.all()
    event = delivery.event
    assert event["kind"] == "engine_model_drift" and event["status"] == "firing"
    assert "Diagnosis: decode step time +37 %" in event["description"]
    # What to do: where a slower decode comes from, and the command that calibrates the group again.
    assert alert.diagnosis["suggestion"].startswith("A decode step reads the weights and the KV cache"), alert.diagnosis
    assert "python manage.py engine calibrate --project alpha --group chat" in alert.diagnosis["suggestion"]
    assert event["diagnosis"]["suggestion"] == alert.diagnosis["suggestion"]

    # The alert's page: what moved and the live error against the bound, no request-component sections (the model's
    # diagnosis has none), and the suggestion.
    user = get_user_model().objects.create_user("ops")
    Membership.objects.create(user=user, project=model.project, role="viewer")
    client = Client()
    client.force_login(user)
    page = client.get(f"/alerts/{alert.fingerprint}/?project=alpha")
    assert page.status_code == 200, page.content[:500]
    text = page.content.decode()
    moved = text[text.index('data-testid="dx-moved"'):]
    moved = moved[:moved.index("</table>")]
    assert "decode step time ◀ moved" in moved and "+37 %" in moved and "prefill time" in moved and "+8 %" in moved
    errors = text[text.index('data-testid="dx-live-error"'):]
    errors = errors[:errors.index("</table>")]
    assert "(bound 20%)" in errors and "p50 TPOT</th><td class=\"num\">−38 %</td><td>over the bound" in errors, errors
    assert "p50 prefill time</th><td class=\"num\">−7 %</td><td>within" in errors, errors
    assert "Component change" not in text and "Contributors" not in text
    assert 'data-testid="dx-suggestion">A decode step reads' in text

    # A newer measurement under the bound: resolved, and the resolution is sent.
    [resolved] = drift.apply(model, FITS, {"decode": 0.01}, t0 + dt.timedelta(seconds=90), drifting=False)
    assert resolved.to_state == AlertState.RESOLVED and resolved.notified
    assert Delivery.objects.count() == 2


def test_a_study_refuses_a_model_that_drifted_with_the_live_figures(model):
    assert engine_model_for(model.project, "chat", CONFIG, allow_unreliable=False) == (model, False)
    EngineModel.objects.filter(id=model.id).update(live_error=DRIFTED, live_moved=SLOWER_DECODE)
    model.refresh_from_db()
    assert not calibration.reliable(model)
    with pytest.raises(StudyError) as refused:
        engine_model_for(model.project, "chat", CONFIG, allow_unreliable=False)
    assert refused.value.status == 409
    message = str(refused.value)
    assert ("error on the latest traffic prefill_ms_p50 -7%, tpot_ms_p50 -38% (worst 38%, the bound is 20%): decode "
            "step time +37 %") in message, message
    assert engine_model_for(model.project, "chat", CONFIG, allow_unreliable=True) == (model, True)


def test_a_saturated_groups_queue_is_not_read_as_the_model_drifting(model):
    """The latest traffic outgrew the group (a page's traffic): its median TTFT is 93 % off the replay, all of it
    queue, while the prefill time and TPOT are within the bound. The model is trusted (calibration.refresh_live_error
    raises the drift alert on the same figures, live_worst)."""
    EngineModel.objects.filter(id=model.id).update(live_error=SATURATED, live_moved={"decode": 0.11, "prefill": -0.05})
    model.refresh_from_db()
    assert calibration.worst_of(model.live_error) == pytest.approx(0.93)  # the TTFT: not what the model is judged on
    assert calibration.live_worst(model.live_error) == pytest.approx(0.12)
    assert calibration.reliable(model) and calibration.unfit_reason(model) is None
    assert engine_model_for(model.project, "chat", CONFIG, allow_unreliable=False) == (model, False)
    # Its prefill time off by more than the bound: refused, with the latest traffic's figures.
    EngineModel.objects.filter(id=model.id).update(live_error={**SATURATED, "prefill_ms_p50": 0.31})
    model.refresh_from_db()
    assert "error on the latest traffic prefill_ms_p50 +31%, tpot_ms_p50 -12% (worst 31%" in \
        calibration.unfit_reason(model)
