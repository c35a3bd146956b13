"""The loop's machine: one tick moves an active loop as far as it can now (service.py draws the states).

- studying: start a tuning study on the group's recent traffic against the burning SLO, within the policy's knobs;
  when it is done, check the confidence the policy asks for (the study's engine model within its error bound, the
  winner confirmed on replicas), take its proposal (knobs within their factors; what it buys, and whether the
  group already completes more than it would serve: ``shortfall``), then stop there (propose), ask an admin
  (approve: a signed, expiring link in the notification) or start the rollout (auto);
- awaiting_approval: expire when nobody decided in time;
- rolling_out: start the rollout with the policy's plan once approved, each latency metric the study predicts the
  winner to worsen judged beyond that prediction (``expecting``); follow it to promoted (watch) or not
  (rolled_back, with the rollout's reason);
- watching: the burning SLO's burn rate over its fastest page tier's short window (5m by default), read from its
  latest evaluation, until the watch ends: restored when it is below 1 then (and when it first fell below 1),
  not_restored otherwise.

Every change is a conditional update on the loop's version (two workers never both act), and every step is in the
audit with its figures. A paused loop is not ticked.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math

from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from fleet.state import FleetUnavailable, UnknownGroup, fleet_group
from rollouts.models import RolloutState
from rollouts.plan import METRIC_LABELS
from rollouts.service import RolloutError, create_rollout
from slo.burn import window_label
from slo.models import SLO
from traces.store import get_store
from tuning import calibration
from tuning.models import ACTIVE_STATES as STUDY_ACTIVE
from tuning.models import StudyState, TuningStudy
from tuning.service import StudyError, create_study, group_config, propose
from tuning.service import cancel as cancel_study

from . import queries
from . import service as S
from .models import ACTIVE_STATES, Loop, LoopState, Mode
from .policy import space_for

log = logging.getLogger(__name__)
SLO_FIGURES = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "e2e_ms": "e2e_ms"}
CLAIM = dt.timedelta(minutes=10)  # how long a tick's claim to create the study or the rollout holds
LOAD_WINDOW = dt.timedelta(minutes=5)  # the group's completed requests over it: a lower bound of its load


def sweep() -> int:
    ids = list(Loop.objects.filter(state__in=ACTIVE_STATES, paused=False).values_list("id", flat=True))
    for loop_id in ids:
        advance(loop_id)
    return len(ids)


def advance(loop_id: int, now: dt.datetime | None = None) -> str | None:
    """One tick of one loop; its state after it."""
    loop = Loop.objects.filter(id=loop_id).select_related("project", "study", "rollout", "slo").first()
    if loop is None or not loop.active or loop.paused:
        return loop.state if loop else None
    try:
        _tick(loop, now or timezone.now())
    except Exception as exc:  # noqa: BLE001 - a step that cannot be done ends the loop with its reason
        log.exception("loop %s: tick failed", loop_id)
        S.stop(Loop.objects.get(id=loop_id), LoopState.FAILED, actor=S.LOOP, reason=f"the loop failed: {exc}")
    return Loop.objects.filter(id=loop_id).values_list("state", flat=True).first()


def _tick(loop: Loop, now: dt.datetime) -> None:
    if loop.state == LoopState.STUDYING:
        _studying(loop, now)
    elif loop.state == LoopState.AWAITING_APPROVAL:
        if loop.approval_expires_at and now >= loop.approval_expires_at:
            S.move(loop, LoopState.EXPIRED, reason=f"nobody approved the rollout within "
                                                   f"{loop.policy.get('approval_seconds')} s", approval_nonce="")
    elif loop.state == LoopState.ROLLING_OUT:
        _rolling_out(loop, now)
    elif loop.state == LoopState.WATCHING:
        _watching(loop, now)


# ---------------------------------------------------------------------------------------------- the study
def _slo_override(loop: Loop) -> dict | None:
    """The burning SLO as the study's target: its latency threshold, or None (the project's SLOs) for others."""
    slo: SLO | None = loop.slo
    if slo is None or slo.sli not in SLO_FIGURES or not slo.threshold_ms:
        return None
    return {SLO_FIGURES[slo.sli]: slo.threshold_ms}


@contextlib.contextmanager
def _claimed(loop: Loop, now: dt.datetime, step: str):
    """Yields whether this tick may create the loop's ``step`` ("study" or "rollout"). It claims it unless another
    tick did within CLAIM (that tick is creating it; an older claim is taken to have died with its worker), and
    releases its claim when it is done, whatever happened."""
    won = Loop.objects.filter(id=loop.id, state=loop.state, **{f"{step}__isnull": True}) \
        .filter(Q(claimed_at__isnull=True) | Q(claimed_at__lt=now - CLAIM)).update(claimed_at=now)
    try:
        yield bool(won)
    finally:
        if won:
            Loop.objects.filter(id=loop.id, claimed_at=now).update(claimed_at=None)


def _create_study(loop: Loop) -> None:
    current, _ = group_config(loop.group)
    policy = loop.policy
    space = space_for(policy["knobs"], current.to_dict())
    if not space:
        S.move(loop, LoopState.FAILED, reason="the policy allows no knob the group's config can change")
        return
    try:
        study = create_study(loop.project, group=loop.group, workload="traffic", space=space,
                             trials=policy["study"]["trials"], slo=_slo_override(loop),
                             confirm=bool(policy["min_confidence"].get("confirmation")),
                             window_hours=policy["study"]["window_hours"], created_by=f"loop {loop.id}")
    except StudyError as exc:
        S.move(loop, LoopState.FAILED, reason=f"the study could not start: {exc}")
        return
    with transaction.atomic():
        won = Loop.objects.filter(id=loop.id, version=loop.version, study__isnull=True).update(study=study)
        if won:
            loop.refresh_from_db()
            S.record(loop, "study_started", S.LOOP, f"tuning study {study.id} on {loop.group}'s last "
                     f"{policy['study']['window_hours']:g} h of traffic, searching {', '.join(space)}",
                     {"study": study.id, "space": space, "slo": study.slo, "engine_model": study.engine_model_id})
    if not won:
        cancel_study(study)


def _confidence(loop: Loop, study: TuningStudy) -> str | None:
    """Why the study's result is not trusted enough for this loop, or None."""
    wanted = loop.policy["min_confidence"]
    bound = wanted.get("model_error")
    if bound is not None:
        model = study.engine_model
        if model is None:
            return (f"the study simulated with the published constants: no calibrated engine model of group "
                    f"{loop.group} (the policy asks for a model error within {bound:.0%})")
        worst = calibration.worst_of(model.held_out_error)
        live = calibration.live_worst(model.live_error)
        if worst is None or worst > bound or (live is not None and live > bound):
            return (f"engine model {model.id}'s error is above the policy's {bound:.0%}: held-out (p50 TTFT, TPOT) "
                    f"{worst if worst is None else f'{worst:.0%}'}, latest traffic (p50 prefill time, TPOT) "
                    f"{live if live is None else f'{live:.0%}'}")
    if wanted.get("confirmation"):
        confirmed = (study.result or {}).get("confirmed_goodput")
        if not confirmed:
            confirmation = (study.result or {}).get("confirmation") or {}
            return ("the winner was not confirmed on replicas: "
                    f"{confirmation.get('error') or confirmation.get('skipped') or 'it met the SLOs at no rate'}")
    return None


def _within_limits(loop: Loop, proposal: dict) -> str | None:
    """Why the proposal changes a knob the policy does not allow, or by more than its factor; None when it does not."""
    knobs = loop.policy["knobs"]
    for knob, change in (proposal.get("diff") or {}).items():
        if knob not in knobs:
            return f"the proposal changes {knob}, which the policy does not allow"
        factor = knobs[knob].get("max_factor")
        old, new = change.get("current"), change.get("proposed")
        if factor and isinstance(old, (int, float)) and isinstance(new, (int, float)) and old > 0 and new > 0 \
                and max(new / old, old / new) > factor * 1.0001:
            return f"the proposal moves {knob} from {old} to {new}, beyond the policy's ×{factor:g}"
    return None


def shortfall(loop: Loop, goodput: float, now: dt.datetime) -> dict | None:
    """When the group completed more requests a second over the last LOAD_WINDOW than its replicas would serve within
    the SLO with the winner (``goodput`` a replica, as the study predicts): the change alone cannot restore the SLO,
    since what arrives is at least what completes (more, under a backlog). On real vLLM a loop promoted a change
    predicted to serve 0.81 req/s against 1.75 req/s that paged, and nothing said so (2026-11-30). None when the
    winner would carry it, or the load or the replicas cannot be read (the check only informs)."""
    if goodput <= 0:
        return None
    try:
        entry, _groups, _live = fleet_group(loop.group)
        replicas = int(entry.get("replicas") or len(entry.get("upstreams") or []) or 1)
        count = queries.completed(get_store(), loop.project_id, loop.group, now - LOAD_WINDOW, now)
    except (UnknownGroup, FleetUnavailable, TypeError, ValueError) as exc:
        log.warning("loop %s: the group's load cannot be read: %s", loop.id, exc)
        return None
    except Exception:  # noqa: BLE001 - the store is away: the proposal goes on without the check
        log.exception("loop %s: the group's completed requests cannot be read", loop.id)
        return None
    load = count / LOAD_WINDOW.total_seconds()
    capacity = goodput * replicas
    if load <= capacity:
        return None
    return {"completed": count, "window_seconds": LOAD_WINDOW.total_seconds(), "completed_per_s": round(load, 4),
            "replicas": replicas, "goodput": goodput, "capacity": round(capacity, 4),
            "replicas_needed": math.ceil(load / goodput)}


def _studying(loop: Loop, now: dt.datetime) -> None:
    study = loop.study
    if study is None:
        with _claimed(loop, now, "study") as mine:
            if mine:
                _create_study(loop)
        return
    if study.state in STUDY_ACTIVE:
        return
    if study.state != StudyState.DONE:
        S.move(loop, LoopState.FAILED, reason=f"tuning study {study.id} {study.state}: {study.error or 'no result'}")
        return
    figures = {"study": study.id, "best": (study.result or {}).get("best"),
               "current": (study.result or {}).get("current"),
               "confirmed_goodput": (study.result or {}).get("confirmed_goodput")}
    doubt = _confidence(loop, study)
    if doubt:
        S.move(loop, LoopState.FAILED, reason=f"not confident enough to change {loop.group}: {doubt}",
               figures=figures)
        return
    try:
        proposal = propose(study, by=f"loop {loop.id}")
    except StudyError as exc:
        S.move(loop, LoopState.FAILED, reason=f"tuning study {study.id}: {exc}", figures=figures)
        return
    beyond = _within_limits(loop, proposal)
    if beyond:
        S.move(loop, LoopState.FAILED, reason=beyond, figures={**figures, "proposal": proposal})
        return
    changes = ", ".join(f"{k}: {v['current']} → {v['proposed']}" for k, v in proposal["diff"].items())
    # What the change buys, in the study's terms: a replica's rate within the SLO (the page's load may be more), both
    # on the same fresh seeds (the study's predicted gain is their ratio).
    result = study.result or {}
    before = (result.get("current_fresh") or result.get("current") or {}).get("goodput")
    after = (result.get("best") or {}).get("goodput")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        changes += f" (predicted goodput {before:.3g} → {after:.3g} req/s a replica within the SLO)"
        short = shortfall(loop, after, now)
        if short:
            figures["shortfall"] = short
            changes += (f"; the group completed {short['completed_per_s']:.3g} req/s over the last "
                        f"{LOAD_WINDOW.total_seconds() / 60:g} minutes, more than its {short['replicas']} replica(s) "
                        f"would serve within the SLO ({short['capacity']:.3g} req/s): the change alone is predicted "
                        f"not to restore the SLO (about {short['replicas_needed']} replicas would)")
    figures["proposal"] = proposal
    if loop.mode == Mode.PROPOSE:
        S.move(loop, LoopState.PROPOSED, reason=f"proposed {changes}; the policy stops at the proposal",
               figures=figures, proposal=proposal)
    elif loop.mode == Mode.APPROVE:
        expires = timezone.now() + dt.timedelta(seconds=loop.policy["approval_seconds"])
        nonce = S.new_nonce()
        pending = Loop(id=loop.id, project=loop.project, approval_nonce=nonce)
        S.move(loop, LoopState.AWAITING_APPROVAL, step="approval_requested",
               reason=f"proposed {changes}; an admin's approval starts the rollout (until {expires:%H:%M:%S} UTC)",
               figures=figures, link=S.approval_link(pending), proposal=proposal, approval_nonce=nonce,
               approval_expires_at=expires)
    else:
        S.move(loop, LoopState.ROLLING_OUT, step="proposed", reason=f"proposed {changes}; the policy is auto",
               figures=figures, proposal=proposal)
        transaction.on_commit(lambda: S.advance_soon(loop.id))


# ---------------------------------------------------------------------------------------------- the rollout
def _rolling_out(loop: Loop, now: dt.datetime) -> None:
    rollout = loop.rollout
    if rollout is None:
        with _claimed(loop, now, "rollout") as mine:
            if mine:
                _create_rollout(loop)
        return
    if rollout.state == RolloutState.PROMOTED:
        until = now + dt.timedelta(seconds=loop.policy["watch_seconds"])
        S.move(loop, LoopState.WATCHING, step="promoted", reason=f"rollout {rollout.id} promoted config "
               f"{rollout.config_version}; the SLO is watched until {until:%H:%M:%S} UTC", watch_until=until,
               figures={"rollout": rollout.id})
    elif rollout.state in (RolloutState.ROLLED_BACK, RolloutState.ABORTED, RolloutState.FAILED):
        S.move(loop, LoopState.ROLLED_BACK, reason=f"rollout {rollout.id} {rollout.state}: {rollout.reason}",
               figures={"rollout": rollout.id})


# A latency metric of the canary analysis → the study's predicted figure of it (search.explain's Measure).
PREDICTED = {"ttft_ms": "ttft_p99", "tpot_ms": "tpot_p99", "e2e_ms": "e2e_p99", "queue_ms": "mean_queue_ms",
             "prefill_ms": "mean_prefill_ms", "decode_ms": "mean_decode_ms"}


def expecting(plan: dict, study: TuningStudy | None) -> tuple[dict, dict[str, float]]:
    """The policy's plan with, on each latency metric the study predicts the winner to worsen, that change as the
    metric's ``expected`` (relative, rounded up to 1%): the canary is then judged on what it does beyond the
    prediction. A config that batches more sequences cuts the queue and makes each token slower by design; judged
    against the baseline alone, TPOT held such a canary inconclusive (real vLLM, 2026-11-30). Predicted
    improvements are not expected of the canary, and a metric whose ``expected`` the policy sets keeps it.
    Returns the plan and the expected changes it set."""
    explanation = ((study.result or {}) if study else {}).get("explanation") or {}
    current, best = explanation.get("current") or {}, explanation.get("best") or {}
    analysis = plan.get("analysis") or {}
    set_here: dict[str, float] = {}
    metrics = []
    for metric in analysis.get("metrics") or []:
        key = PREDICTED.get(metric["metric"])
        before, after = current.get(key), best.get(key)
        if "expected" not in metric and metric.get("direction") == "increase" and before and after and before > 0 \
                and after > before:
            change = min(math.ceil(round((after / before - 1.0) * 100, 6)) / 100, 10.0)  # 1.1 → 0.10, not 0.11
            metric = {**metric, "expected": change}
            set_here[metric["metric"]] = change
        metrics.append(metric)
    if not set_here:
        return plan, {}
    return {**plan, "analysis": {**analysis, "metrics": metrics}}, set_here


def _create_rollout(loop: Loop) -> None:
    plan, expected = expecting(loop.policy["plan"], loop.study)
    try:
        rollout = create_rollout(loop.project, group=loop.group, from_study=loop.study_id,
                                 plan=plan, created_by=f"loop {loop.id}")
    except RolloutError as exc:
        S.move(loop, LoopState.FAILED, reason=f"the rollout could not start: {exc}")
        return
    with transaction.atomic():
        won = type(loop).objects.filter(id=loop.id, version=loop.version, rollout__isnull=True).update(rollout=rollout)
        if won:
            loop.refresh_from_db()
            judged = "; the canary is judged beyond the study's predicted " + ", ".join(
                f"{METRIC_LABELS[m]} {v:+.0%}" for m, v in expected.items()) if expected else ""
            S.record(loop, "rollout_started", S.LOOP, f"rollout {rollout.id} of config "
                     f"{rollout.config_version} to {loop.group} ({len(rollout.plan['steps'])} steps){judged}",
                     {"rollout": rollout.id, "plan": rollout.plan, "expected": expected})


def burn_now(loop: Loop) -> tuple[str, float | None, str]:
    """(the window, the burning SLO's burn rate over it or None when unknown, what it was judged on) at its latest
    evaluation: the short window of its fastest page tier (5m with the default tiers), the one that says whether it
    burns now. A window with fewer requests than the SLO's min_requests says nothing: right after a promotion's
    drain-and-replace, an empty minute read as a burn rate of 0."""
    slo = SLO.objects.filter(id=loop.slo_id).first() if loop.slo_id else None
    if slo is None:
        return "5m", None, "no SLO"
    tiers = sorted(slo.burn_tiers, key=lambda t: (t.severity != "page", t.short_window))
    label = window_label(tiers[0].short_window) if tiers else "5m"
    status = slo.last_status or {}
    rate = (status.get("burn_rates") or {}).get(label)
    total = ((status.get("counts") or {}).get(label) or {}).get("total")
    if rate is None or total is None:
        return label, None, "no evaluation yet"
    if total < slo.min_requests:
        return label, None, f"{total} requests < min_requests {slo.min_requests}"
    return label, rate, f"{total} requests"


def _watching(loop: Loop, now: dt.datetime) -> None:
    window, rate, basis = burn_now(loop)
    if rate is not None and rate < 1 and loop.restored_at is None:
        with transaction.atomic():
            if Loop.objects.filter(id=loop.id, version=loop.version).update(restored_at=now):
                loop.refresh_from_db()
                S.record(loop, "burn_below_1", S.LOOP, f"the SLO's {window} burn rate is {rate:.2f} ({basis}), "
                         f"below 1, {(now - loop.created_at).total_seconds():.0f} s after the page",
                         {"window": window, "burn_rate": rate, "basis": basis,
                          "seconds_since_page": (now - loop.created_at).total_seconds()})
    if loop.watch_until and now >= loop.watch_until:
        figures = {"window": window, "burn_rate": rate, "basis": basis,
                   "restored_at": loop.restored_at.isoformat() if loop.restored_at else None}
        if rate is not None and rate < 1:
            S.move(loop, LoopState.RESTORED, reason=f"the SLO's {window} burn rate is {rate:.2f} ({basis}) at the "
                   f"watch's end", figures=figures)
        elif rate is None:
            S.move(loop, LoopState.NOT_RESTORED, reason=f"the watch ended with no {window} burn rate to judge "
                   f"({basis})", figures=figures)
        else:
            S.move(loop, LoopState.NOT_RESTORED, reason=f"the SLO still burns at the watch's end ({window} burn "
                   f"rate {rate:.2f}, {basis})", figures=figures)
