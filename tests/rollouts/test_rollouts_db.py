"""The rollout state machine against the metadata database, without a fleet: conditional transitions (a stale
writer loses), a fleet that cannot be reached pauses the rollout with that reason, a rollback is notified through
the project's channels even when the fleet is away (its clean-up stays pending, retried by the sweep), the
alert diagnosis names the rollout, the overview's annotations."""
from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from fleet_support import unreachable_fleet_file

pytestmark = pytest.mark.django_db


@pytest.fixture
def unreachable_fleet(tmp_path, monkeypatch):
    """A fleet file whose controller is not running (its control port refuses), with a control token."""
    fleet = unreachable_fleet_file(tmp_path, "  - {name: base, weight: 1, replicas: 1, backend: simulator, "
                                             "config: {model: meta-llama/Llama-3.1-8B-Instruct}}\n")
    monkeypatch.setenv("ENGINE_FLEET", str(fleet))
    return fleet


def _rollout(project, **fields):
    from rollouts import service
    from rollouts.models import Rollout

    created = service.create_rollout(project, group="base", config={"max_num_seqs": 64},
                                     plan={"steps": [{"canary": 10, "interval": 120}]}, created_by="alice")
    if fields:
        Rollout.objects.filter(id=created.id).update(**fields)
    return Rollout.objects.get(id=created.id)


def test_a_stale_writer_loses_and_writes_no_audit_row(unreachable_fleet):
    from rollouts import transitions
    from tenancy.models import Project

    rollout = _rollout(Project.objects.create(name="p"))
    stale = type(rollout).objects.get(id=rollout.id)
    transitions.transition(rollout, to_state="progressing", action="started", reason="first")
    with pytest.raises(transitions.Conflict):
        transitions.transition(stale, to_state="progressing", action="started", reason="second")
    assert [t.action for t in rollout.transitions.all()] == ["created", "started"]


def test_an_unreachable_fleet_pauses_with_the_reason_after_the_grace(unreachable_fleet, settings):
    from rollouts import machine
    from tenancy.models import Project

    settings.ROLLOUTS = {**settings.ROLLOUTS, "FLEET_GRACE_SECONDS": 0.0}
    rollout = _rollout(Project.objects.create(name="p"))
    machine.advance(rollout.id)  # notes when the fleet was first missed
    rollout.refresh_from_db()
    assert rollout.state == "pending" and rollout.step_status.get("fleet_unreachable_since")
    machine.advance(rollout.id)
    rollout.refresh_from_db()
    assert rollout.state == "paused" and "cannot reach the fleet" in rollout.reason \
        and "does not answer" in rollout.reason
    assert rollout.step_status["pause"] == "fleet" and rollout.paused_from == "pending"
    assert rollout.ticking_until is None


def test_a_rollback_is_notified_and_its_cleanup_stays_pending_while_the_fleet_is_away(unreachable_fleet):
    from notify.models import Channel, Delivery
    from rollouts import controls, machine, service
    from tenancy.models import Project

    project = Project.objects.create(name="p")
    Channel.objects.create(project=project, name="hook", kind="webhook", url="https://hooks.example.com/x")
    rollout = _rollout(project, state="progressing")
    controls.abort(rollout, "user:alice", "not today")
    rollout.refresh_from_db()
    assert rollout.state == "aborted" and rollout.reason == "not today"
    assert rollout.step_status["cleanup"] == "pending"
    [delivery] = Delivery.objects.filter(channel__project=project)
    event = delivery.event
    assert event["kind"] == "rollout" and event["labels"]["state"] == "aborted" and event["summary"] == "not today"
    assert event["rollout"]["id"] == rollout.id and delivery.severity == "ticket"
    # The sweep keeps trying the clean-up of a finished rollout.
    assert machine.sweep() == 1
    with pytest.raises(service.RolloutError, match="cannot be promoted"):
        controls.promote_now(rollout, "user:alice")


def test_the_diagnosis_and_the_overview_name_the_rollout(unreachable_fleet):
    from alerts.diagnosis import with_rollouts
    from rollouts import service, transitions
    from tenancy.models import Project

    project = Project.objects.create(name="p")
    rollout = _rollout(project)
    rollout = transitions.transition(rollout, to_state="progressing", action="started", reason="go",
                                     step_status={"traffic_since": timezone.now().isoformat()})
    rollout = transitions.transition(rollout, action="canary-weight", reason="canary takes 10%")
    now = timezone.now()
    diagnosis = with_rollouts({"summary": "queue time rose"}, project.id, (now - dt.timedelta(minutes=5), now))
    assert diagnosis["rollouts"][0]["id"] == rollout.id and diagnosis["rollouts"][0]["canary_weight"] == 10
    assert diagnosis["summary"].startswith(f"During rollout #{rollout.id} of group base (progressing, canary 10%)")
    assert diagnosis["summary"].endswith("queue time rose")
    other = Project.objects.create(name="q")
    assert with_rollouts({"summary": "x"}, other.id, (now - dt.timedelta(minutes=5), now))["rollouts"] == []
    marks = service.annotations(project.id, now - dt.timedelta(minutes=5), now + dt.timedelta(seconds=1))
    assert [m["label"] for m in marks] == [f"rollout #{rollout.id} (base): started",
                                           f"rollout #{rollout.id} (base): canary 10%"]


def test_a_study_whose_winner_does_not_beat_the_current_config_starts_no_rollout(unreachable_fleet):
    """A study that found nothing better on fresh seeds (its result's no_gain) proposes nothing: a rollout from it is
    refused with that reason, as `propose` refuses it; a study with a winner that gains is taken."""
    from rollouts import service
    from tenancy.models import Project
    from tuning.models import StudyState, TuningStudy

    project = Project.objects.create(name="alpha")
    common = {"project": project, "group": "base", "current_config": {"max_num_seqs": 256}, "workload": {},
              "slo": {}, "space": {}, "state": StudyState.DONE}
    reason = "on 5 fresh seeds the winner scores 41.20 req/s against the current config's 41.90 req/s"
    flat = TuningStudy.objects.create(**common, result={"best": {"config": {"max_num_seqs": 128}}, "no_gain": reason})
    with pytest.raises(service.RolloutError) as refused:
        service.create_rollout(project, group="base", from_study=flat.id, created_by="alice")
    assert refused.value.status == 409 and reason in str(refused.value), refused.value
    gaining = TuningStudy.objects.create(**common, result={"best": {"config": {"max_num_seqs": 128}}})
    rollout = service.create_rollout(project, group="base", from_study=gaining.id, created_by="alice")
    assert rollout.config["max_num_seqs"] == 128
