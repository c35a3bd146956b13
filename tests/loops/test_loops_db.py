"""The closed loop against the metadata database, notify's real enqueue and Django's URL routing, with a fleet file
whose controller is away (the loop reads the group's config from the file; nothing is started here): policies and
their refusals, what a page starts (or not: off, an unmanaged group, a cooldown, a freeze, a busy group, two pages),
a finished study's proposal through each mode, the confidence the policy asks for, and the approval links (once,
before expiry, genuine, of the project, by admins only). The live loop on a simulated fleet is
tests/loops/test_loops_live.py."""
from __future__ import annotations

import datetime as dt
import json

import pytest
from alerts.models import Alert, AlertKind
from alerts_support import insert_requests, installed_store, request_row
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from fleet_support import unreachable_fleet_file
from loops import machine, service
from loops.models import Loop, LoopPolicy
from notify.models import Channel, Delivery
from tenancy.models import ApiToken, Membership, Project
from tuning.models import EngineModel, ModelState, StudyState, TuningStudy

from engine.config import EngineConfig

pytestmark = pytest.mark.django_db
CONFIG = {"model": "meta-llama/Llama-3.1-8B-Instruct", "max_num_seqs": 32, "max_num_batched_tokens": 4096}


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    """A fleet file with the managed group `base` whose controller is not running."""
    path = unreachable_fleet_file(tmp_path, f"  - {{name: base, weight: 1, replicas: 1, backend: simulator, "
                                            f"config: {json.dumps(CONFIG)}}}\n")
    monkeypatch.setenv("ENGINE_FLEET", str(path))
    return path


def _token(username: str, project: Project, role: str) -> str:
    user, _ = get_user_model().objects.get_or_create(username=username)
    Membership.objects.create(user=user, project=project, role=role)
    return ApiToken.issue(user, role=role)[1]


@pytest.fixture(scope="module")
def store():
    """A scratch ClickHouse store that traces.store.get_store() hands out for the module's tests (a loop reads the
    group's completed requests when it proposes)."""
    with installed_store() as scratch:
        yield scratch


@pytest.fixture
def world(fleet, settings, store):
    settings.ALERTS = {**settings.ALERTS, "PUBLIC_URL": "https://obs.example"}
    alpha, beta = Project.objects.create(name="alpha"), Project.objects.create(name="beta")
    Channel.objects.create(project=alpha, name="hook", kind="webhook", url="http://127.0.0.1:9/hook")
    return {"alpha": alpha, "beta": beta, "admin": _token("ada", alpha, "admin"),
            "operator": _token("otto", alpha, "operator"), "viewer": _token("vic", alpha, "viewer"),
            "outsider": _token("bob", beta, "admin")}


def api(world, who: str, method: str, path: str, body=None):
    client = Client()
    response = getattr(client, method.lower())(f"/api/v1{path}", data=json.dumps(body) if body is not None else None,
                                               content_type="application/json",
                                               HTTP_AUTHORIZATION=f"Bearer {world[who]}")
    return response.status_code, response.json()


def page(project: Project, *, group: str = "base", component: str = "queue", severity: str = "page") -> Alert:
    diagnosis = {"dominant_component": component, "summary": f"{component} time rose",
                 "contributors": {"replica_group": [{"value": group, "requests": 100, "bad": 60}]}}
    now = timezone.now()
    return Alert.objects.create(
        project=project, kind=AlertKind.SLO_BURN, fingerprint=f"fp-{Alert.objects.count()}", severity=severity,
        state="firing", labels={"alertname": "SLOErrorBudgetBurn", "project": project.name, "slo": "chat-ttft"},
        annotations={"title": "SLO chat-ttft burns"}, diagnosis=diagnosis, context={}, started_at=now, fired_at=now,
        last_values={"burn_rates": {"5m": 20.0, "1h": 15.0}})


def policy(world, **body) -> tuple[int, dict]:
    return api(world, "admin", "PUT", "/loop-policies", {"plan": {"steps": [{"canary": 10, "interval": 120}]},
                                                         **body})


def test_a_policy_is_refused_with_every_problem(world):
    from regressions.models import Dataset, DatasetVersion

    dataset = Dataset.objects.create(project=world["alpha"], name="golden")
    DatasetVersion.objects.create(dataset=dataset, number=1, item_count=1)
    status, body = api(world, "admin", "PUT", "/loop-policies", {
        "mode": "auto", "cooldown": 0, "knobs": {"max_num_seqs": {"max_factor": 2}, "warp_drive": {}},
        "plan": {"steps": [{"canary": 10, "interval": 120}]}, "extra": 1})
    assert status == 400, body
    reasons = [p["reason"] for p in body["problems"]]
    assert any("'warp_drive' is not a knob the engine has" in r for r in reasons), reasons
    assert any("auto needs a cooldown above 0" in r for r in reasons), reasons
    assert any("the project has a golden dataset (golden): the loop's rollouts need a regression gate" in r
               for r in reasons), reasons
    assert any("extra: not a field" in r for r in reasons), reasons
    assert not LoopPolicy.objects.exists()
    gated = {"steps": [{"gate": {"dataset": "golden"}}, {"canary": 10}]}
    status, body = api(world, "admin", "PUT", "/loop-policies", {"group": "nowhere", "mode": "auto", "plan": gated})
    assert status == 400 and "not a replica group of the managed fleet" in body["error"], body
    for who in ("operator", "viewer"):
        assert api(world, who, "PUT", "/loop-policies", {"mode": "auto"})[0] == 403
    status, body = api(world, "admin", "PUT", "/loop-policies", {"mode": "auto", "cooldown": "6h", "plan": gated})
    assert status == 200 and body["mode"] == "auto" and body["cooldown_seconds"] == 21600, body


@pytest.mark.parametrize("mode,started", [("off", False), ("propose", True), ("approve", True), ("auto", True)])
def test_a_page_on_an_engine_component_starts_a_loop_unless_off(world, mode, started):
    assert policy(world, mode=mode)[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    assert (loop is not None) == started
    if started:
        assert loop.state == "studying" and loop.group == "base" and loop.mode == mode
        assert [s.step for s in loop.steps.all()] == ["started"]
        assert Delivery.objects.filter(event__kind="loop").count() == 1  # every step is a notification


def test_what_starts_no_loop(world):
    assert policy(world, mode="auto", cooldown="6h", freeze=[
        {"days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"], "from": "00:00", "to": "24:00"}])[0] == 200
    assert service.start_from_alert(page(world["alpha"])) is None  # frozen every day
    assert policy(world, mode="auto", cooldown="6h")[0] == 200
    assert service.start_from_alert(page(world["alpha"], component="network")) is None  # not an engine component
    assert service.start_from_alert(page(world["alpha"], severity="ticket")) is None  # a ticket, not a page
    assert service.start_from_alert(page(world["alpha"], group="elsewhere")) is None  # not a managed group
    first = service.start_from_alert(page(world["alpha"]))
    assert first is not None
    assert service.start_from_alert(page(world["alpha"])) is None  # two pages on one group: one loop
    service.end(first, "ada")
    assert service.start_from_alert(page(world["alpha"])) is None  # cooldown
    Loop.objects.filter(id=first.id).update(created_at=timezone.now() - dt.timedelta(hours=7))
    assert service.start_from_alert(page(world["alpha"])) is not None
    assert Loop.objects.count() == 2


def _done_study(loop: Loop, *, proposed: dict, confirmed: float | None = 12.0, model_error: float | None = 0.05,
                live_error: dict | None = None):
    current = EngineConfig.from_dict(CONFIG)
    model = None
    if model_error is not None:
        now = timezone.now()
        model = EngineModel.objects.create(
            project=loop.project, group="base", config_version=current.version, config=current.to_dict(),
            window_start=now - dt.timedelta(hours=1), window_end=now, state=ModelState.FITTED, base_profile="H100",
            held_out_error={"ttft_ms_p50": model_error, "tpot_ms_p50": -model_error}, live_error=live_error or {})
    best = {**current.to_dict(), **proposed}
    study = TuningStudy.objects.create(
        project=loop.project, group="base", current_config=current.to_dict(), workload={}, slo={}, space={},
        trials=5, state=StudyState.DONE, engine_model=model, confirm=True,
        result={"best": {"config": best, "goodput": 14.0}, "current": {"goodput": 8.0},
                "current_fresh": {"goodput": 7.5}, "predicted_gain": 1.87,
                "confirmed_goodput": confirmed, "confirmation": {"confirmed_goodput": confirmed}})
    Loop.objects.filter(id=loop.id).update(study=study)
    return study


def test_propose_stops_at_the_proposal_and_auto_goes_on_to_the_rollout(world):
    assert policy(world, mode="propose")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    _done_study(loop, proposed={"max_num_seqs": 64})
    assert machine.advance(loop.id) == "proposed"
    loop.refresh_from_db()
    assert loop.proposal["diff"] == {"max_num_seqs": {"current": 32, "proposed": 64}} and loop.finished_at
    assert ("proposed max_num_seqs: 32 → 64 (predicted goodput 7.5 → 14 req/s a replica within the SLO); the policy "
            "stops at the proposal") in loop.reason, loop.reason
    Loop.objects.all().delete()
    assert policy(world, mode="auto", cooldown="1h")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    _done_study(loop, proposed={"max_num_seqs": 64})
    assert machine.advance(loop.id) == "rolling_out"
    assert machine.advance(loop.id) == "rolling_out"  # the rollout is created on the next tick
    loop.refresh_from_db()
    assert loop.rollout is not None and loop.rollout.config["max_num_seqs"] == 64
    assert loop.rollout.created_by == f"loop {loop.id}" and loop.rollout.study_id == loop.study_id
    steps = [s.step for s in loop.steps.all()]
    assert steps == ["started", "proposed", "rollout_started"], steps


def test_the_rollout_judges_a_metric_the_study_predicts_worse_beyond_that_prediction(world):
    """The study predicts the winner cuts the queue and slows each token (TPOT p99 20.0 → 24.3 ms, e2e 1000 → 1100
    ms, decode 400 → 480 ms): the loop's rollout expects TPOT +22% and e2e +10%, not the improvements, and keeps
    what the policy set itself (decode)."""
    plan = {"steps": [{"canary": 10, "interval": 120}],
            "analysis": {"metrics": ["ttft_ms", "tpot_ms", "queue_ms", "e2e_ms",
                                     {"metric": "decode_ms", "expected": 0.5}]}}
    assert policy(world, mode="auto", plan=plan)[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    study = _done_study(loop, proposed={"max_num_seqs": 64})
    study.result["explanation"] = {
        "current": {"ttft_p99": 900.0, "tpot_p99": 20.0, "e2e_p99": 1000.0, "mean_queue_ms": 300.0,
                    "mean_decode_ms": 400.0},
        "best": {"ttft_p99": 300.0, "tpot_p99": 24.3, "e2e_p99": 1100.0, "mean_queue_ms": 20.0,
                 "mean_decode_ms": 480.0}}
    study.save(update_fields=["result"])
    assert machine.advance(loop.id) == "rolling_out"
    assert machine.advance(loop.id) == "rolling_out"
    loop.refresh_from_db()
    metrics = {m["metric"]: m for m in loop.rollout.plan["analysis"]["metrics"]}
    assert metrics["tpot_ms"]["expected"] == 0.22 and metrics["e2e_ms"]["expected"] == 0.1
    assert "expected" not in metrics["ttft_ms"] and "expected" not in metrics["queue_ms"]
    assert metrics["decode_ms"]["expected"] == 0.5  # the policy's own
    started = loop.steps.get(step="rollout_started")
    assert "judged beyond the study's predicted TPOT +22%, e2e latency +10%" in started.reason, started.reason
    assert started.figures["expected"] == {"tpot_ms": 0.22, "e2e_ms": 0.1}
    # Without the study's explanation the policy's plan goes through as it is.
    assert machine.expecting(loop.policy["plan"], None) == (loop.policy["plan"], {})


def test_a_proposal_that_serves_less_than_the_group_completes_says_so(world, store):
    """The winner is predicted to serve 0.8 req/s a replica within the SLO; the group's one replica completed 420
    requests in the last 5 minutes (1.4 req/s), and what arrives is at least that: the proposal says the change
    alone will not restore the SLO. Requests of another group or project, or completed before the window, do not
    count."""
    assert policy(world, mode="propose")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    study = _done_study(loop, proposed={"max_num_seqs": 64})
    study.result.update(best={**study.result["best"], "goodput": 0.8}, current_fresh={"goodput": 0.4})
    study.save(update_fields=["result"])
    now = timezone.now()
    alpha, beta = world["alpha"].id, world["beta"].id
    e2e = dt.timedelta(milliseconds=60_548)  # request_row's components with a minute of queue

    def done_at(project_id: int, at: dt.datetime, group: str = "base") -> dict:
        return request_row(project_id, at - e2e, queue=60_000.0, replica_group=group)

    rows = [done_at(alpha, now - dt.timedelta(seconds=295 - i * 0.7)) for i in range(420)]
    rows += [done_at(alpha, now - dt.timedelta(seconds=200), group="other") for _ in range(100)]
    rows += [done_at(beta, now - dt.timedelta(seconds=200)) for _ in range(100)]
    rows += [done_at(alpha, now - dt.timedelta(seconds=400)) for _ in range(50)]
    insert_requests(store, rows)
    try:
        assert machine.advance(loop.id) == "proposed"
    finally:
        store.command(f"TRUNCATE TABLE {store.table('llm_requests')}")
    loop.refresh_from_db()
    assert ("the group completed 1.4 req/s over the last 5 minutes, more than its 1 replica(s) would serve within "
            "the SLO (0.8 req/s): the change alone is predicted not to restore the SLO (about 2 replicas would)"
            ) in loop.reason, loop.reason
    proposed = loop.steps.get(step="proposed")
    assert proposed.figures["shortfall"] == {"completed": 420, "window_seconds": 300.0, "completed_per_s": 1.4,
                                             "replicas": 1, "goodput": 0.8, "capacity": 0.8, "replicas_needed": 2}


def test_a_tick_while_another_creates_the_study_or_the_rollout_leaves_it_to_that_tick(world, monkeypatch):
    """Ticks overlap (the beat's sweep every 2 s, a step's advance_soon): only the tick that claimed the step creates
    its study or rollout. Before the claim, a loop's start created up to four studies, three then cancelled."""
    from tuning.service import StudyError

    assert policy(world, mode="auto", cooldown="1h")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    now = timezone.now()
    Loop.objects.filter(id=loop.id).update(claimed_at=now - dt.timedelta(minutes=9))  # another tick is on it
    studies = []

    def no_traffic(*args, **kwargs):  # this database-only world has no traffic store: the study cannot start
        studies.append(kwargs["group"])
        assert machine.advance(loop.id) == "studying"  # a second tick meanwhile leaves it to this one
        raise StudyError("no traffic in the window")

    monkeypatch.setattr(machine, "create_study", no_traffic)
    assert machine.advance(loop.id, now) == "studying" and studies == []
    Loop.objects.filter(id=loop.id).update(claimed_at=now - dt.timedelta(minutes=11))  # that tick died with its worker
    assert machine.advance(loop.id, now) == "failed" and studies == ["base"]
    assert Loop.objects.get(id=loop.id).reason == "the study could not start: no traffic in the window"

    Loop.objects.all().delete()
    loop = service.start_from_alert(page(world["alpha"]))
    _done_study(loop, proposed={"max_num_seqs": 64})
    assert machine.advance(loop.id) == "rolling_out"
    real, rollouts = machine.create_rollout, []

    def slow_create_rollout(*args, **kwargs):
        rollouts.append(kwargs["group"])
        assert machine.advance(loop.id) == "rolling_out"  # a second tick meanwhile leaves it to this one
        return real(*args, **kwargs)

    monkeypatch.setattr(machine, "create_rollout", slow_create_rollout)
    assert machine.advance(loop.id) == "rolling_out"
    loop.refresh_from_db()
    assert rollouts == ["base"] and loop.rollout is not None and loop.claimed_at is None
    assert [s.step for s in loop.steps.all()] == ["started", "proposed", "rollout_started"]


@pytest.mark.parametrize("study,words", [
    ({"proposed": {"max_num_seqs": 64}, "model_error": None}, "no calibrated engine model"),
    ({"proposed": {"max_num_seqs": 64}, "model_error": 0.3}, "error is above the policy's 20%: held-out (p50 TTFT, "
                                                              "TPOT) 30%"),
    # The latest traffic's prefill time off by more than the bound (its TTFT, mostly queue, is not what is judged).
    ({"proposed": {"max_num_seqs": 64}, "live_error": {"ttft_ms_p50": 0.1, "prefill_ms_p50": -0.25, "tpot_ms_p50": 0.1}},
     "latest traffic (p50 prefill time, TPOT) 25%"),
    ({"proposed": {"max_num_seqs": 64}, "confirmed": None}, "the winner was not confirmed on replicas"),
    ({"proposed": {"max_num_seqs": 256}}, "moves max_num_seqs from 32 to 256, beyond the policy's ×2"),
    ({"proposed": {"block_size": 32}}, "changes block_size, which the policy does not allow"),
])
def test_a_result_the_policy_does_not_trust_ends_the_loop_with_the_reason(world, study, words):
    assert policy(world, mode="auto", cooldown="1h")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    _done_study(loop, **study)
    assert machine.advance(loop.id) == "failed"
    loop.refresh_from_db()
    assert words in loop.reason, loop.reason
    assert loop.rollout is None


def test_a_saturated_groups_queue_does_not_end_the_loop(world):
    """The page's traffic outgrew the group: the model's median TTFT on it is 93 % off, all of it queue (a few per
    cent of capacity either way moves a growing queue several-fold); its prefill time and TPOT are within the
    bound. The loop trusts the model and goes on to the rollout."""
    assert policy(world, mode="auto", cooldown="1h")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    _done_study(loop, proposed={"max_num_seqs": 64},
                live_error={"ttft_ms_p50": -0.93, "queue_ms_p50": -0.97, "prefill_ms_p50": 0.04, "tpot_ms_p50": -0.12})
    assert machine.advance(loop.id) == "rolling_out"


def _awaiting(world) -> tuple[Loop, str]:
    assert policy(world, mode="approve", approval_expires="1h")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    _done_study(loop, proposed={"max_num_seqs": 64})
    assert machine.advance(loop.id) == "awaiting_approval"
    loop.refresh_from_db()
    step = loop.steps.get(step="approval_requested")
    [delivery] = Delivery.objects.filter(id__in=step.delivery_ids)
    link = delivery.event["annotations"]["approval_url"]
    assert link.startswith("https://obs.example/loops/approve/") and link in delivery.event["description"]
    return loop, link.rsplit("/", 1)[1]


def test_approve_waits_for_an_admin_through_the_link_and_a_link_works_once(world):
    loop, token = _awaiting(world)
    assert machine.advance(loop.id) == "awaiting_approval"  # nothing changes before the approval
    status, seen = api(world, "admin", "GET", f"/loop-approvals/{token}")
    assert status == 200 and seen["id"] == loop.id and seen["state"] == "awaiting_approval"  # a GET changes nothing
    for who, code in (("viewer", 403), ("operator", 403), ("outsider", 404)):
        status, body = api(world, who, "POST", f"/loop-approvals/{token}", {"approve": True})
        assert status == code, (who, body)
    assert Loop.objects.get(id=loop.id).state == "awaiting_approval"
    status, body = api(world, "admin", "POST", f"/loop-approvals/{token}", {"approve": True})
    assert status == 202 and body["state"] == "rolling_out", body
    assert [s["actor"] for s in body["steps"] if s["step"] == "approved"] == ["ada"]
    status, body = api(world, "admin", "POST", f"/loop-approvals/{token}", {"approve": True})
    assert status == 410 and "used or replaced" in body["error"], body  # reused


def test_a_denial_ends_the_loop_and_forged_or_expired_links_do_nothing(world):
    loop, token = _awaiting(world)
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    status, body = api(world, "admin", "POST", f"/loop-approvals/{forged}", {"approve": True})
    assert status == 403 and "not genuine" in body["error"], body
    Loop.objects.filter(id=loop.id).update(approval_expires_at=timezone.now() - dt.timedelta(seconds=1))
    status, body = api(world, "admin", "POST", f"/loop-approvals/{token}", {"approve": True})
    assert status == 410 and "expired" in body["error"], body
    assert machine.advance(loop.id) == "expired"
    Loop.objects.all().delete()

    loop, token = _awaiting(world)
    status, body = api(world, "admin", "POST", f"/loop-approvals/{token}", {"approve": False, "reason": "not now"})
    assert status == 202 and body["state"] == "denied" and body["reason"] == "not now", body
    assert Loop.objects.get(id=loop.id).rollout is None


def test_the_loops_api_is_per_project_and_humans_pause_resume_and_end(world):
    assert policy(world, mode="auto", cooldown="1h")[0] == 200
    loop = service.start_from_alert(page(world["alpha"]))
    status, listed = api(world, "viewer", "GET", "/loops")
    assert status == 200 and [x["id"] for x in listed["loops"]] == [loop.id]
    assert api(world, "outsider", "GET", f"/loops/{loop.id}")[0] == 404
    assert api(world, "viewer", "POST", f"/loops/{loop.id}/pause")[0] == 403
    status, body = api(world, "operator", "POST", f"/loops/{loop.id}/pause")
    assert status == 202 and body["paused"], body
    _done_study(loop, proposed={"max_num_seqs": 64})
    assert machine.advance(loop.id) == "studying"  # paused: not ticked
    assert api(world, "operator", "POST", f"/loops/{loop.id}/resume")[0] == 403
    assert api(world, "admin", "POST", f"/loops/{loop.id}/resume")[0] == 202
    status, body = api(world, "admin", "POST", f"/loops/{loop.id}/end", {"reason": "doing it by hand"})
    assert status == 202 and body["state"] == "ended" and body["reason"] == "doing it by hand", body
    assert [s["step"] for s in body["steps"]] == ["started", "paused", "resumed", "ended"]
    assert api(world, "admin", "POST", f"/loops/{loop.id}/end")[0] == 409


def test_a_page_through_the_alerts_lifecycle_starts_the_loop_and_a_canary_page_aborts_it(
        world, django_capture_on_commit_callbacks):
    """The alerts' lifecycle calls the loop once a page's firing commits (LoopsConfig.ready() registered it)."""
    from alerts.lifecycle import AlertSpec, drive

    assert policy(world, mode="auto", cooldown="1h")[0] == 200

    def spec(key: str) -> AlertSpec:
        return AlertSpec(project_id=world["alpha"].id, project_name="alpha", kind=AlertKind.SLO_BURN, key=key,
                         severity="page", labels={"alertname": "SLOErrorBudgetBurn", "project": "alpha"},
                         annotations={"title": f"SLO {key} burns"}, values={}, context={}, title=f"SLO {key} burns",
                         summary="")

    def blaming(group: str):
        return lambda *args, **kwargs: {"dominant_component": "prefill", "summary": "prefill time rose",
                                        "contributors": {"replica_group": [{"value": group}]}}

    with django_capture_on_commit_callbacks(execute=True):
        drive(spec("chat-ttft"), True, timezone.now(), diagnose_fn=blaming("base"))
    [loop] = Loop.objects.all()
    assert loop.state == "studying" and loop.trigger["component"] == "prefill"
    assert loop.alert.fingerprint == loop.alert_fingerprint
    _done_study(loop, proposed={"max_num_seqs": 64})
    machine.advance(loop.id)
    machine.advance(loop.id)
    loop.refresh_from_db()
    assert loop.state == "rolling_out" and loop.rollout is not None
    # A page whose diagnosis blames the canary aborts the loop; its rollout is rolled back.
    with django_capture_on_commit_callbacks(execute=True):
        drive(spec("chat-tpot"), True, timezone.now(), diagnose_fn=blaming(loop.rollout.canary_group))
    loop.refresh_from_db()
    loop.rollout.refresh_from_db()
    assert loop.state == "aborted" and loop.rollout.canary_group in loop.reason, loop.reason
    assert loop.rollout.state in ("rolled_back", "aborted"), loop.rollout.state
    assert Loop.objects.count() == 1  # the canary's page started no loop of its own (not a managed group)


def _status(burn_5m: float, requests_5m: int) -> dict:
    """An SLO's last_status as its evaluation writes it: the burn rates and the counts of each window."""
    return {"burn_rates": {"5m": burn_5m, "1h": 8.0},
            "counts": {"5m": {"total": requests_5m, "bad": round(burn_5m * 0.01 * requests_5m)},
                       "1h": {"total": 12 * requests_5m, "bad": 12 * requests_5m}}}


def test_a_promoted_loop_watches_the_slo_and_ends_restored_or_not(world):
    from rollouts.models import Rollout
    from slo import services as slos
    from slo.models import SLO

    slo = slos.create(world["alpha"].id, {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 500,
                                          "objective": "99%", "filters": {"replica_group": ["base"]}})
    assert policy(world, mode="auto", cooldown="1h", watch="10m")[0] == 200
    for rate_at_end, final in ((0.4, "restored"), (3.0, "not_restored")):
        Loop.objects.all().delete()
        alert = page(world["alpha"])
        Alert.objects.filter(id=alert.id).update(slo=slo)
        alert.refresh_from_db()
        loop = service.start_from_alert(alert)
        _done_study(loop, proposed={"max_num_seqs": 64})
        machine.advance(loop.id)
        machine.advance(loop.id)
        loop.refresh_from_db()
        Rollout.objects.filter(id=loop.rollout_id).update(state="promoted")
        SLO.objects.filter(id=slo.id).update(last_status=_status(20.0, 300))
        assert machine.advance(loop.id) == "watching"
        assert machine.advance(loop.id) == "watching" and Loop.objects.get(id=loop.id).restored_at is None
        # Fewer requests than the SLO's min_requests (20) say nothing, however low their burn: right after a
        # drain-and-replace, an empty window read as 0.00 and recorded the burn below 1 (real vLLM, 2026-11-30).
        for empty in (0, 19):
            SLO.objects.filter(id=slo.id).update(last_status=_status(0.0, empty))
            assert machine.advance(loop.id) == "watching" and Loop.objects.get(id=loop.id).restored_at is None
        SLO.objects.filter(id=slo.id).update(last_status=_status(0.4, 300))
        assert machine.advance(loop.id) == "watching"
        assert Loop.objects.get(id=loop.id).restored_at is not None  # when the burn first fell below 1
        assert "burn rate is 0.40 (300 requests), below 1" in Loop.objects.get(id=loop.id).steps.last().reason
        SLO.objects.filter(id=slo.id).update(last_status=_status(rate_at_end, 300))
        Loop.objects.filter(id=loop.id).update(watch_until=timezone.now() - dt.timedelta(seconds=1))
        assert machine.advance(loop.id) == final
        steps = [s.step for s in Loop.objects.get(id=loop.id).steps.all()]
        assert steps == ["started", "proposed", "rollout_started", "promoted", "burn_below_1", final], steps
    # A watch that ends on a window too thin to judge ends not restored, and says why.
    Loop.objects.filter(id=loop.id).update(state="watching", version=0, finished_at=None, reason="")
    loop.refresh_from_db()
    SLO.objects.filter(id=slo.id).update(last_status=_status(0.0, 4))
    assert machine.advance(loop.id) == "not_restored"
    assert Loop.objects.get(id=loop.id).reason == ("the watch ended with no 5m burn rate to judge (4 requests < "
                                                   "min_requests 20)")


def test_the_loop_pages_show_the_timeline_and_the_link_decides_only_on_an_admins_post(world):
    loop, token = _awaiting(world)
    users = get_user_model().objects
    admin, viewer = Client(), Client()
    admin.force_login(users.get(username="ada"))
    viewer.force_login(users.get(username="vic"))
    listing = admin.get("/loops/").content.decode()
    assert f'data-loop="{loop.id}"' in listing and "awaiting_approval" in listing and "<code>max_num_seqs</code>" \
        in listing  # the policy's knobs
    page_text = admin.get(f"/loops/{loop.id}/").content.decode()
    for step in ("started", "approval_requested"):
        assert f'data-step="{step}"' in page_text
    assert 'data-testid="approve"' in page_text and "32" in page_text and "64" in page_text  # the proposal
    assert 'data-testid="approve"' not in viewer.get(f"/loops/{loop.id}/").content.decode()

    seen = admin.get(f"/loops/approve/{token}")
    assert seen.status_code == 200 and 'data-testid="decide"' in seen.content.decode()
    assert Loop.objects.get(id=loop.id).state == "awaiting_approval"  # a GET never acts
    assert "Only an admin" in viewer.get(f"/loops/approve/{token}").content.decode()
    assert viewer.post(f"/loops/approve/{token}", {"decision": "approve"}).status_code == 403
    assert Loop.objects.get(id=loop.id).state == "awaiting_approval"
    forged = admin.get(f"/loops/approve/{token[:-3]}xyz")
    assert forged.status_code == 403 and "not genuine" in forged.content.decode()
    done = admin.post(f"/loops/approve/{token}", {"decision": "approve", "reason": "go"})
    assert done.status_code == 302 and Loop.objects.get(id=loop.id).state == "rolling_out"
    again = admin.get(f"/loops/approve/{token}")
    assert again.status_code == 410 and "Nothing was changed" in again.content.decode()
