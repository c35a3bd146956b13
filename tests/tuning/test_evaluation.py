"""POST /api/v1/engine-models/{id}/evaluate through Django's URL routing and views, on a scratch trace store: a model
evaluated on a window of its group's traffic that its own constants produced (errors near zero) and on the same
window with the published constants (off by what the fit moved); every bad window refused with what is wrong; another
project's model not revealed. (tests/tuning/test_evaluation_real_vllm.py evaluates models fitted on real vLLM.)"""
from __future__ import annotations

import datetime as dt
import json
import random

import pytest
from alerts_support import insert_requests, request_row
from django.contrib.auth import get_user_model
from django.test import Client
from tenancy.models import ApiToken, Membership, Project
from tuning import evaluation
from tuning.models import EngineModel, ModelState

from engine.config import EngineConfig
from engine.sim import traffic_fit as F
from engine.sim.profiles import hardware_profile

CONFIG = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu_type="L4", max_num_seqs=32, max_model_len=4096)
_L4 = hardware_profile("L4")
FITTED = {"mfu": _L4.mfu * 1.4, "bandwidth_efficiency": _L4.bandwidth_efficiency * 0.65}
ALPHA, BETA = 9301, 9302
T0 = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=3)).replace(microsecond=0)
SERVED = (T0, T0 + dt.timedelta(minutes=1))  # 150 requests its own constants produced, config CONFIG
OTHER = (T0 + dt.timedelta(minutes=10), T0 + dt.timedelta(minutes=11))  # 60 requests of another config


def _served_rows() -> list[dict]:
    """150 Poisson requests at 2.5 req/s with the engine timings the simulator gives them under FITTED."""
    rng = random.Random(7)
    clock, observed = 0.0, []
    for _ in range(150):
        clock += rng.expovariate(2.5)
        observed.append(F.Observed(clock, rng.randint(200, 900), rng.randint(20, 60)))
    predicted = F.replay(CONFIG, _L4.with_constants(**FITTED), observed)
    rows = []
    for row, (ttft, tpot, queue) in zip(observed, predicted):
        rows.append(request_row(ALPHA, SERVED[0] + dt.timedelta(seconds=row.arrival), engine_config=CONFIG.version,
                                replica_group="chat", prompt_tokens=row.prompt_tokens,
                                completion_tokens=row.output_tokens, queue=queue, prefill=ttft - queue,
                                decode=tpot * (row.output_tokens - 1)))
    return rows


@pytest.fixture(scope="module")
def traffic(store):
    insert_requests(store, _served_rows())
    insert_requests(store, [request_row(ALPHA, OTHER[0] + dt.timedelta(seconds=i), engine_config="cfg-other",
                                        replica_group="chat") for i in range(60)])
    return store


def _token(username: str, project: Project, role: str) -> str:
    user, _ = get_user_model().objects.get_or_create(username=username)
    Membership.objects.create(user=user, project=project, role=role)
    return ApiToken.issue(user, role=role)[1]


@pytest.fixture
def world(db, traffic):
    alpha, beta = Project.objects.create(id=ALPHA, name="alpha"), Project.objects.create(id=BETA, name="beta")
    model = EngineModel.objects.create(
        project=alpha, group="chat", config_version=CONFIG.version, config=CONFIG.to_dict(),
        window_start=T0 - dt.timedelta(hours=1), window_end=T0, state=ModelState.FITTED, base_profile="L4",
        constants=FITTED, start_constants={name: getattr(_L4, name) for name in FITTED}, queue_floor_ms=5.0,
        held_out_error={"ttft_ms_p50": 0.01, "tpot_ms_p50": 0.01})
    return {"model": model, "viewer": _token("carol", alpha, "viewer"), "outsider": _token("bob", beta, "operator")}


def evaluate(world, body, *, who: str = "viewer", model_id: int | None = None) -> tuple[int, dict]:
    response = Client().post(f"/api/v1/engine-models/{model_id or world['model'].id}/evaluate",
                             data=json.dumps(body), content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {world[who]}")
    return response.status_code, response.json()


def _iso(at: dt.datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def test_a_model_on_traffic_its_constants_served_and_the_published_constants_on_the_same(world):
    window = {"since": _iso(SERVED[0]), "until": _iso(SERVED[1] + dt.timedelta(minutes=1))}
    status, seen = evaluate(world, window)
    assert status == 200, seen
    assert seen["model_id"] == world["model"].id and seen["constants"] == "model" and seen["requests"] == 150
    assert set(seen["error"]) == {f"{f}_p{q}" for f in F.FIGURES for q in F.QUANTILES}
    assert all(abs(value) < 0.02 for value in seen["error"].values()), seen["error"]
    assert seen["within_bound"] == {"count": 6, "of": 6} and seen["bound"] == 0.2
    assert seen["profile"] == pytest.approx(FITTED)
    assert seen["observed"]["tpot_ms_p50"] == pytest.approx(seen["predicted"]["tpot_ms_p50"], rel=0.02)
    assert seen["observed"]["ttft_ms_p95"] >= seen["observed"]["ttft_ms_p50"] > 0
    assert set(seen["curves"]) == set(F.FIGURES) and seen["diagnosis"].startswith("no cost moved")

    # The published constants it started from: the bandwidth 35 % higher than the traffic's, so TPOT too short.
    status, published = evaluate(world, {**window, "constants": "published"})
    assert status == 200, published
    assert published["profile"]["bandwidth_efficiency"] == pytest.approx(_L4.bandwidth_efficiency)
    assert published["error"]["tpot_ms_p50"] < -0.2, published["error"]
    assert published["within_bound"]["count"] < 6 and published["moved"]["decode"] > 0.2, published
    assert published["observed"] == seen["observed"]  # the same traffic
    # Nothing is stored: the model's live figures are the worker's alone.
    world["model"].refresh_from_db()
    assert world["model"].live_error == {} and world["model"].live_at is None


def test_a_window_given_in_hours_ends_at_until(world):
    status, seen = evaluate(world, {"until": _iso(SERVED[1] + dt.timedelta(seconds=30)), "window_hours": 0.05})
    assert status == 200 and seen["requests"] == 150, seen
    assert seen["window"]["since"].startswith((SERVED[1] + dt.timedelta(seconds=30) - dt.timedelta(hours=0.05))
                                              .isoformat()[:19])


@pytest.mark.parametrize("body,status,words", [
    ({"since": "2026-13-01T00:00:00Z"}, 400, "ISO 8601"),
    ({"since": "yesterday"}, 400, "ISO 8601"),
    ({"since": _iso(SERVED[1]), "until": _iso(SERVED[0])}, 400, "must end after it starts"),
    ({"since": _iso(SERVED[0] - dt.timedelta(days=8)), "until": _iso(SERVED[1])}, 400, "at most 7 days"),
    ({"since": _iso(SERVED[0]), "window_hours": 1}, 400, "not both"),
    ({"window_hours": 200}, 400, "window_hours"),
    ({"window_hours": 0}, 400, "window_hours"),
    ({"since": _iso(SERVED[0]), "constants": "secret"}, 400, "constants"),
    ({"since": _iso(SERVED[0]), "extra": 1}, 400, "extra"),
    # Before any traffic: none of the group's requests (the counts say what is missing).
    ({"since": _iso(T0 - dt.timedelta(hours=2)), "until": _iso(T0 - dt.timedelta(hours=1))}, 400,
     "too little traffic: 0 engine-served requests of group 'chat' in the window, 0 of them"),
    # Only requests of another config than the model's: constants fitted under one config say nothing of another.
    ({"since": _iso(OTHER[0]), "until": _iso(OTHER[1])}, 409, "the window's traffic ran config cfg-other"),
    ({"since": _iso(SERVED[0]), "until": _iso(OTHER[1])}, 409, "several configs"),
])
def test_bad_windows_are_refused_with_what_is_wrong(world, body, status, words):
    got, answer = evaluate(world, body)
    assert got == status, answer
    assert words in json.dumps(answer), answer


def test_a_window_busier_than_one_replay_holds_is_refused(world, monkeypatch):
    monkeypatch.setattr(evaluation, "MAX_REQUESTS", 100)
    status, answer = evaluate(world, {"since": _iso(SERVED[0]), "until": _iso(SERVED[1] + dt.timedelta(minutes=1))})
    assert status == 400 and "holds 150 requests" in answer["error"] and "narrow the window" in answer["error"]


def test_a_model_that_is_not_fitted_is_409_and_another_projects_model_404(world):
    EngineModel.objects.filter(id=world["model"].id).update(state=ModelState.FAILED)
    status, answer = evaluate(world, {"since": _iso(SERVED[0])})
    assert status == 409 and "is failed: only a fitted model" in answer["error"], answer
    status, answer = evaluate(world, {"since": _iso(SERVED[0])}, who="outsider")
    assert status == 404, answer
    status, answer = evaluate(world, {"since": _iso(SERVED[0])}, model_id=2**40)
    assert status == 404, answer


def test_a_model_this_simulator_cannot_replay_is_409(world):
    EngineModel.objects.filter(id=world["model"].id).update(base_profile="TPU-9")
    window = {"since": _iso(SERVED[0]), "until": _iso(SERVED[1] + dt.timedelta(minutes=1)), "constants": "published"}
    status, answer = evaluate(world, window)
    assert status == 409 and "cannot be replayed here" in answer["error"] and "TPU-9" in answer["error"], answer
