"""The alert state machine: pending → firing → resolved, one notification per transition however many workers run.

Identity: an alert is its fingerprint, sha256 of (project, kind, SLO id or regression key, severity); the row
is reused across episodes (resolved → pending starts a new one).

Rules (times are evaluation times):
- the condition holds and there is no active alert → pending (no notification);
- pending, and the condition still holds at an evaluation at least `for` after it became pending → firing
  (`for`: ALERTS["PAGE_FOR_SECONDS"] 0 s, so a page fires at the evaluation that finds it: the burn-rate tier's
  short window is its debounce; ALERTS["TICKET_FOR_SECONDS"] 290 s);
- pending, condition gone → inactive (never notified); firing, condition gone → resolved;
- an evaluation older than the alert's last one is ignored (a slow worker of a doubled beat).

Exactly once: every change is a conditional UPDATE on (id, state, version) whose row count is checked; the
winner writes the AlertTransition row and calls notify.enqueue() inside the same DB transaction, so the claim
and its Delivery rows commit together or not at all (a crash in between leaves the old state, and the next
evaluation makes the same transition). A loser re-reads the row and decides again, which finds nothing to do.

Muting: a firing alert matched by a silence, or a ticket alert of an SLO whose page alert fires (inhibition,
as Alertmanager's severity inhibit rule), changes state but sends nothing; check_repeats() notifies it once it
is no longer muted. A resolved notification is sent iff the episode's firing was notified (even if a silence
started since: the receiver's incident must close).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
import uuid
from collections.abc import Callable

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone
from notify.services import enqueue
from slo.burn import window_label
from slo.queries import MODEL_ERROR_SLI

from . import metrics
from .diagnosis import diagnose
from .model_check_diagnosis import diagnose_model_checks
from .models import Alert, AlertKind, AlertState, AlertTransition, Severity
from .silences import silencing

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
_fired_listeners: list[Callable] = []
SLO_ALERTNAME = "SLOErrorBudgetBurn"
REGRESSION_ALERTNAME = "LatencyRegression"
MODEL_DRIFT_ALERTNAME = "EngineModelDrift"
_UNSET = object()


def cfg(name: str, default):
    return getattr(settings, "ALERTS", {}).get(name, default)


def fingerprint(project_id: int, kind: str, key: str, severity: str) -> str:
    raw = "\x1f".join((str(project_id), kind, str(key), severity))
    return hashlib.sha256(raw.encode()).hexdigest()


def pending_for(severity: str) -> dt.timedelta:
    seconds = cfg("PAGE_FOR_SECONDS", 0.0) if severity == Severity.PAGE else cfg("TICKET_FOR_SECONDS", 290.0)
    return dt.timedelta(seconds=float(seconds))


@dataclasses.dataclass
class AlertSpec:
    """What one evaluation says about one alert identity."""

    project_id: int
    project_name: str
    kind: str
    key: str
    severity: str
    labels: dict
    annotations: dict
    values: dict
    context: dict  # how to diagnose it again (filters, SLI, windows)
    title: str
    summary: str
    slo_id: int | None = None
    slo_info: dict | None = None
    reason: str = ""
    resolved_title: str = ""
    repeat_interval: dt.timedelta = dt.timedelta(hours=4)
    # Context kept from the episode's start (a regression's frozen baseline) instead of this evaluation's.
    keep_context_keys: tuple[str, ...] = ()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.project_id, self.kind, self.key, self.severity)


@dataclasses.dataclass(frozen=True)
class _Step:
    from_state: str
    to_state: str
    reason: str
    notify: bool = False


def on_fired(listener: Callable) -> None:
    """Call ``listener(alert)`` once an alert's transition to firing has committed (once per listener): a higher
    room acts on a page (the closed loop) without this one knowing it."""
    if listener not in _fired_listeners:
        _fired_listeners.append(listener)


def _fired(alert_id: int) -> None:
    alert = Alert.objects.filter(id=alert_id).first()
    for listener in _fired_listeners if alert is not None else ():
        try:
            listener(alert)
        except Exception:
            log.exception("%s failed for alert %s", getattr(listener, "__qualname__", listener), alert_id)


# -- driving one alert -------------------------------------------------------------------------------------------
def drive(spec: AlertSpec, active: bool, at: dt.datetime, *, hold: bool = False, alert=_UNSET,
          diagnose_fn: Callable | None = None) -> list[AlertTransition]:
    """Apply one evaluation (`active`: the condition holds) to the alert `spec` identifies; `hold` keeps the
    state whatever the condition (no-data policy "keep"). Returns the transitions this call claimed."""
    fp = spec.fingerprint
    claimed: list[AlertTransition] = []
    for _attempt in range(MAX_ATTEMPTS):
        if alert is _UNSET:
            alert = Alert.objects.filter(fingerprint=fp).first()
        if alert is None:
            if not active or hold:
                return claimed
            transition = _create_pending(spec, at)
            alert = _UNSET
            if transition is not None:
                claimed.append(transition)
            continue  # re-read: the winner's row may fire at once (for = 0)
        if alert.last_evaluated_at is not None and at < alert.last_evaluated_at:
            return claimed  # a newer evaluation has been applied already
        step = None if hold else _next_step(alert, active, at, spec)
        if step is None:
            _touch(alert, spec, at)
            return claimed
        transition = _claim(alert, spec, step, at, diagnose_fn)
        alert = _UNSET
        if transition is None:
            continue  # another worker changed the row first: decide again from what it wrote
        claimed.append(transition)
        if transition.to_state != AlertState.PENDING:
            return claimed
    log.warning("alert %s: gave up after %d contended attempts", fp, MAX_ATTEMPTS)
    return claimed


def _next_step(alert: Alert, active: bool, at: dt.datetime, spec: AlertSpec) -> _Step | None:
    state = alert.state
    if state == AlertState.PENDING:
        if not active:
            return _Step(state, AlertState.INACTIVE, "condition cleared before firing")
        if at - alert.started_at >= pending_for(alert.severity):
            return _Step(state, AlertState.FIRING, spec.reason or "condition held for the pending period", notify=True)
        return None
    if state == AlertState.FIRING:
        if not active:
            return _Step(state, AlertState.RESOLVED, "condition cleared", notify=alert.last_notified_at is not None)
        return None
    if active:  # resolved or inactive: a new episode
        return _Step(state, AlertState.PENDING, spec.reason or "condition holds")
    return None


def _create_pending(spec: AlertSpec, at: dt.datetime) -> AlertTransition | None:
    try:
        with transaction.atomic():
            alert = Alert.objects.create(
                project_id=spec.project_id, slo_id=spec.slo_id, kind=spec.kind, fingerprint=spec.fingerprint,
                severity=spec.severity, state=AlertState.PENDING, version=1, episode=1, labels=spec.labels,
                annotations=spec.annotations, context=spec.context, last_values=spec.values, started_at=at,
                last_evaluated_at=at, created_at=timezone.now(), updated_at=timezone.now(),
            )
            metrics.transition_claimed(spec.kind, spec.severity, AlertState.PENDING)
            return AlertTransition.objects.create(
                alert=alert, from_state="", to_state=AlertState.PENDING, at=at, episode=1,
                reason=(spec.reason or "condition holds")[:300], values=spec.values,
            )
    except IntegrityError:
        return None  # another worker created it


def _touch(alert: Alert, spec: AlertSpec, at: dt.datetime) -> None:
    """Record the evaluation on a pending or firing alert (no version bump: not a claim)."""
    if alert.state not in (AlertState.PENDING, AlertState.FIRING):
        return
    Alert.objects.filter(pk=alert.pk).filter(Q(last_evaluated_at__isnull=True) | Q(last_evaluated_at__lte=at)).update(
        last_evaluated_at=at, last_values=spec.values, updated_at=timezone.now())


def _claim(alert: Alert, spec: AlertSpec, step: _Step, at: dt.datetime,
           diagnose_fn: Callable | None) -> AlertTransition | None:
    fields: dict = {"state": step.to_state, "version": F("version") + 1, "last_evaluated_at": at,
                    "last_values": spec.values, "labels": spec.labels, "annotations": spec.annotations,
                    "updated_at": timezone.now()}
    episode = alert.episode
    context = _merged_context(alert, spec)
    diagnosis = alert.diagnosis
    muted: dict = {}
    if step.to_state == AlertState.PENDING:
        episode = alert.episode + 1
        context = dict(spec.context)
        fields.update(started_at=at, fired_at=None, resolved_at=None, last_notified_at=None, episode=episode,
                      diagnosis=None, context=context)
        diagnosis = None
    elif step.to_state == AlertState.FIRING:
        # Outside the transaction: it reads ClickHouse. Both racing workers compute it; one keeps it.
        diagnosis = run_diagnosis(alert.project_id, context, alert.started_at, at, diagnose_fn)
        muted = muting(alert.project_id, spec.labels, alert.severity, alert.slo_id, at)
        fields.update(fired_at=at, diagnosis=diagnosis, context=context)
        if not muted:
            fields["last_notified_at"] = at
    elif step.to_state == AlertState.RESOLVED:
        fields.update(resolved_at=at)
    notify = step.notify and not muted
    with transaction.atomic():
        won = Alert.objects.filter(pk=alert.pk, state=alert.state, version=alert.version).update(**fields)
        if won != 1:
            return None
        alert.refresh_from_db()
        transition = AlertTransition(
            alert=alert, from_state=step.from_state, to_state=step.to_state, at=at, episode=episode,
            reason=step.reason[:300], values=spec.values, muted=muted,
        )
        if notify:
            event = build_event(alert, spec, status="firing" if step.to_state == AlertState.FIRING else "resolved",
                                at=at, diagnosis=diagnosis)
            transition.event_id = uuid.UUID(event["event_id"])
            transition.notified = True
            transition.delivery_ids = _enqueue(alert.project_id, event, alert.severity)
        transition.save()
        metrics.transition_claimed(alert.kind, alert.severity, step.to_state)
        if step.to_state == AlertState.FIRING and _fired_listeners:
            alert_id = alert.id
            transaction.on_commit(lambda: _fired(alert_id))
    return transition


def _merged_context(alert: Alert, spec: AlertSpec) -> dict:
    context = dict(spec.context)
    for key in spec.keep_context_keys:
        if key in (alert.context or {}):
            context[key] = alert.context[key]
    return context


def _enqueue(project_id: int, event: dict, severity: str) -> list[int]:
    return list(enqueue(project_id, event, severity=severity))


# -- muting ------------------------------------------------------------------------------------------------------
def muting(project_id: int, labels: dict, severity: str, slo_id: int | None, at: dt.datetime) -> dict:
    """{"silences": [ids]} when silenced, {"inhibited_by": fingerprint} when a page alert of the same SLO fires
    (tickets only), else {}."""
    silences = silencing(project_id, labels, at)
    if silences:
        return {"silences": silences}
    if severity == Severity.TICKET and slo_id is not None:
        page = (Alert.objects.filter(slo_id=slo_id, kind=AlertKind.SLO_BURN, severity=Severity.PAGE,
                                     state=AlertState.FIRING).values_list("fingerprint", flat=True).first())
        if page:
            return {"inhibited_by": page}
    return {}


# -- diagnosis ---------------------------------------------------------------------------------------------------
def diagnosis_windows(context: dict, started_at: dt.datetime, at: dt.datetime):
    """(burning, baseline) windows of a diagnosis at `at`.

    Regression: the detector's current window, against the baseline frozen when the episode began.
    SLO burn: from the short window before the alert became pending up to now, between the tier's short and
    long windows; the baseline is the window of the same length just before it, at least
    ALERTS["DIAGNOSIS_BASELINE_MIN_SECONDS"] (30 min) long."""
    if context.get("kind") == "regression":
        window = dt.timedelta(seconds=context["window_seconds"])
        baseline_until = dt.datetime.fromisoformat(context["baseline_until"])
        baseline_len = dt.timedelta(seconds=context["baseline_seconds"])
        return (at - window, at), (baseline_until - baseline_len, baseline_until)
    short = dt.timedelta(seconds=context.get("short_seconds", 300))
    long = dt.timedelta(seconds=context.get("long_seconds", 3600))
    length = min(max(at - started_at + short, short), max(long, short))
    baseline_len = max(length, dt.timedelta(seconds=cfg("DIAGNOSIS_BASELINE_MIN_SECONDS", 1800)))
    since = at - length
    return (since, at), (since - baseline_len, since)


def run_diagnosis(project_id: int, context: dict, started_at: dt.datetime, at: dt.datetime,
                  diagnose_fn: Callable | None = None) -> dict:
    """The alert's diagnosis; an error is recorded in it rather than blocking the notification. An alert raised with
    its cause already known (an engine model's drift names the cost that moved) carries its diagnosis in its
    context: that one is returned as it is."""
    if isinstance(context.get("diagnosis"), dict):
        return dict(context["diagnosis"])
    burning, baseline = diagnosis_windows(context, started_at, at)
    try:
        if context.get("sli") == MODEL_ERROR_SLI:  # checks of an engine model, not requests: what the checks said
            return diagnose_model_checks(project_id, context.get("filters") or {}, burning,
                                         threshold=context["threshold"])
        return (diagnose_fn or diagnose)(project_id, context.get("filters") or {}, burning, baseline,
                                         sli=context.get("sli") or "e2e_ms", threshold_ms=context.get("threshold_ms"),
                                         include_cached=bool(context.get("include_cached")))
    except Exception as exc:  # ClickHouse away, a bad filter: the page must still go out
        log.warning("diagnosis failed for project %s: %s", project_id, exc)
        return {"error": f"diagnosis unavailable: {exc}"[:500],
                "burning": {"since": _iso(burning[0]), "until": _iso(burning[1])},
                "baseline": {"since": _iso(baseline[0]), "until": _iso(baseline[1])}}


# -- events ------------------------------------------------------------------------------------------------------
def build_event(alert: Alert, spec: AlertSpec | None, *, status: str, at: dt.datetime, diagnosis: dict | None,
                repeat: bool = False) -> dict:
    """The neutral event notify renders per channel kind."""
    labels = dict(alert.labels)
    annotations = dict(alert.annotations)
    title = (spec.title if spec else annotations.get("title")) or labels.get("alertname", alert.kind)
    summary = (spec.summary if spec else annotations.get("summary")) or title
    if status == "resolved":
        title = (spec.resolved_title if spec and spec.resolved_title else f"Resolved: {title}")
    description = summary
    if diagnosis and diagnosis.get("summary"):
        description = f"{summary}\nDiagnosis: {diagnosis['summary']}"
    public = cfg("PUBLIC_URL", "") or ""
    return {
        "event_id": str(uuid.uuid4()),
        "fingerprint": alert.fingerprint,
        "status": status,
        "severity": alert.severity,
        "kind": alert.kind,
        "project": labels.get("project", ""),
        "title": title,
        "summary": summary,
        "description": description,
        "labels": {k: str(v) for k, v in labels.items()},
        "annotations": {k: str(v) for k, v in annotations.items() if k not in ("title",)},
        "starts_at": _iso(alert.started_at),
        "ends_at": _iso(at) if status == "resolved" else None,
        "url": f"{public.rstrip('/')}/api/v1/alerts/{alert.fingerprint}" if public else None,
        "slo": spec.slo_info if spec else _current_slo_info(alert),
        "diagnosis": diagnosis,
        "repeat": repeat,
    }


def _current_slo_info(alert: Alert) -> dict | None:
    """The SLO part of a repeat's event: the definition kept at firing, the newest burn rates and budget."""
    info = (alert.context or {}).get("slo_info")
    if info is None:
        return None
    values = alert.last_values or {}
    return {**info, **{k: values[k] for k in ("burn_rates", "budget_remaining") if k in values}}


def _iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


# -- SLO evaluations ---------------------------------------------------------------------------------------------
def apply_evaluation(slo, evaluation) -> list[AlertTransition]:
    """Drive the SLO's page and ticket alerts from one Evaluation (slo/burn.py).

    page active   = the firing tier (fastest burning, unsuppressed) is a page tier;
    ticket active = the firing tier is a ticket tier, or a ticket tier burns under a firing page (its
                    notifications are then inhibited by the page);
    no data       = what the SLO's policy put in `evaluation.firing` ("ok": nothing, "alert": the ticket tier
                    "no_data"); "keep" holds every alert of the SLO as it is.
    """
    at = evaluation.at
    hold = evaluation.state == "no_data" and getattr(slo, "no_data", "ok") == "keep"
    firing = evaluation.firing
    by_severity = {}
    for severity in (Severity.PAGE, Severity.TICKET):
        tier = firing if firing is not None and firing.tier.severity == severity else None
        if tier is None and severity == Severity.TICKET:
            tier = next((t for t in evaluation.tiers if t.burning and t.tier.severity == severity), None)
        by_severity[severity] = tier
    existing = {a.fingerprint: a for a in Alert.objects.filter(slo_id=slo.id, kind=AlertKind.SLO_BURN)}
    transitions = []
    for severity in (Severity.PAGE, Severity.TICKET):
        tier = by_severity[severity]
        spec = slo_alert_spec(slo, evaluation, severity, tier)
        transitions += drive(spec, tier is not None, at, hold=hold, alert=existing.get(spec.fingerprint))
    return transitions


def slo_alert_spec(slo, evaluation, severity: str, tier) -> AlertSpec:
    project_name = slo.project.name
    filters = {k: v for k, v in (slo.filters or {}).items() if v}
    labels = {"alertname": SLO_ALERTNAME, "project": project_name, "slo": slo.name, "sli": slo.sli,
              "severity": severity}
    for name, values in filters.items():
        labels[name] = ",".join(values) if isinstance(values, list) else str(values)
    for name, value in (slo.labels or {}).items():
        labels.setdefault(str(name), str(value))
    objective = f"{slo.objective * 100:g}%"
    if slo.sli == "error_ratio":
        what = "requests that do not fail"
    elif slo.sli == MODEL_ERROR_SLI:
        what = f"live checks of the engine model within {slo.threshold:.0%} (p50 prefill time and TPOT)"
    else:
        what = f"requests with {slo.sli} ≤ {slo.threshold_ms:g} ms"
    budget = evaluation.budget_remaining
    budget_text = f"{budget:.0%} of the error budget left" if budget is not None else "error budget unknown"
    if tier is not None:
        long_label, short_label = window_label(tier.tier.long_window), window_label(tier.tier.short_window)
        burn = tier.long_burn
        if tier.tier.name == "no_data":
            title = f"SLO {slo.name}: no data ({severity})"
            rate = "no checks" if slo.sli == MODEL_ERROR_SLI else "no requests"
        else:
            title = f"SLO {slo.name}: error budget burning {burn:.1f}× ({severity})" if burn is not None else (
                f"SLO {slo.name}: error budget burning ({severity})")
            rate = (f"burn rate {_x(tier.long_burn)} over {long_label} and {_x(tier.short_burn)} over {short_label} "
                    f"(tier {tier.tier.name}, factor {tier.tier.factor:g})")
        annotations = {"tier": tier.tier.name, "long_window": long_label, "short_window": short_label,
                       "factor": f"{tier.tier.factor:g}", "reason": tier.reason}
        context_windows = {"short_seconds": tier.tier.short_window.total_seconds(),
                           "long_seconds": tier.tier.long_window.total_seconds()}
        reason = tier.reason
    else:
        title = f"SLO {slo.name}: error budget burn ({severity})"
        rate = f"state {evaluation.state}"
        annotations = {}
        context_windows = {}
        reason = f"evaluation state {evaluation.state}"
    summary = f"SLO {slo.name} ({objective} of {what} over {slo.period_days} d): {rate}; {budget_text}."
    annotations.update(summary=summary, title=title, budget_remaining="" if budget is None else f"{budget:.4f}")
    if slo.description:
        annotations["slo_description"] = slo.description
    values = {"state": evaluation.state, "burn_rates": dict(evaluation.burn_rates),
              "budget_remaining": budget, "firing_tier": tier.tier.name if tier is not None else None}
    slo_info = {"name": slo.name, "sli": slo.sli, "threshold_ms": slo.threshold_ms,
                **({"threshold": slo.threshold} if slo.sli == MODEL_ERROR_SLI else {}), "objective": slo.objective,
                "period_days": slo.period_days, "filters": filters, "burn_rates": dict(evaluation.burn_rates),
                "budget_remaining": budget, "tier": tier.tier.as_dict() if tier is not None else None,
                "state": evaluation.state}
    context = {"kind": "slo", "filters": filters, "sli": slo.sli, "threshold_ms": slo.threshold_ms,
               **({"threshold": slo.threshold} if slo.sli == MODEL_ERROR_SLI else {}),
               "include_cached": slo.include_cached, "slo_info": slo_info, **context_windows}
    return AlertSpec(
        project_id=slo.project_id, project_name=project_name, kind=AlertKind.SLO_BURN, key=str(slo.id),
        severity=severity, labels=labels, annotations=annotations, values=values, context=context, title=title,
        summary=summary, slo_id=slo.id, slo_info=slo_info, reason=reason[:300],
        resolved_title=f"SLO {slo.name}: error budget burn resolved ({severity})",
        repeat_interval=dt.timedelta(seconds=getattr(slo, "repeat_interval_seconds", 4 * 3600) or 4 * 3600),
    )


def _x(value) -> str:
    return "n/a" if value is None else f"{value:.1f}×"


# -- repeats and orphans -----------------------------------------------------------------------------------------
def repeat_interval(alert: Alert) -> dt.timedelta:
    override = cfg("REPEAT_INTERVAL_SECONDS", 0)
    if override:
        return dt.timedelta(seconds=override)
    if alert.kind == AlertKind.SLO_BURN and alert.slo is not None:
        return dt.timedelta(seconds=alert.slo.repeat_interval_seconds)
    return dt.timedelta(seconds=cfg("REGRESSION_REPEAT_INTERVAL_SECONDS", 4 * 3600))


def check_repeats(now: dt.datetime | None = None, *, diagnose_fn: Callable | None = None,
                  refresh_diagnosis: bool = True) -> int:
    """Notify firing alerts again every repeat interval (with a fresh diagnosis unless `refresh_diagnosis` is
    False), notify firing alerts whose silence or inhibition ended and that were never notified, and resolve
    alerts whose SLO was deleted or disabled. Returns the number of notifications and transitions claimed."""
    now = now or timezone.now()
    done = 0
    orphans = Alert.objects.filter(kind=AlertKind.SLO_BURN, state__in=(AlertState.PENDING, AlertState.FIRING)).filter(
        Q(slo__isnull=True) | Q(slo__enabled=False))
    for alert in orphans:
        done += _resolve_orphan(alert, now)
    for alert in Alert.objects.filter(state=AlertState.FIRING).select_related("slo"):
        interval = repeat_interval(alert)
        if alert.last_notified_at is not None and now - alert.last_notified_at < interval:
            continue
        if muting(alert.project_id, alert.labels, alert.severity, alert.slo_id, now):
            continue
        if _notify_again(alert, now, diagnose_fn, refresh_diagnosis):
            done += 1
    return done


def _notify_again(alert: Alert, now: dt.datetime, diagnose_fn: Callable | None, refresh: bool = True) -> bool:
    repeat = alert.last_notified_at is not None
    diagnosis = (run_diagnosis(alert.project_id, alert.context or {}, alert.started_at, now, diagnose_fn)
                 if refresh else alert.diagnosis)
    with transaction.atomic():
        won = Alert.objects.filter(pk=alert.pk, state=AlertState.FIRING, version=alert.version).update(
            version=F("version") + 1, last_notified_at=now, diagnosis=diagnosis, updated_at=timezone.now())
        if won != 1:
            return False
        alert.refresh_from_db()
        event = build_event(alert, None, status="firing", at=now, diagnosis=diagnosis, repeat=repeat)
        AlertTransition.objects.create(
            alert=alert, from_state=AlertState.FIRING, to_state=AlertState.FIRING, at=now, episode=alert.episode,
            reason="repeat interval elapsed" if repeat else "no longer muted: first notification",
            event_id=uuid.UUID(event["event_id"]), notified=True,
            delivery_ids=_enqueue(alert.project_id, event, alert.severity), values=alert.last_values,
        )
    return True


def _resolve_orphan(alert: Alert, now: dt.datetime) -> int:
    reason = "SLO deleted" if alert.slo_id is None else "SLO disabled"
    from_state = alert.state
    to_state = AlertState.RESOLVED if alert.state == AlertState.FIRING else AlertState.INACTIVE
    notify = to_state == AlertState.RESOLVED and alert.last_notified_at is not None
    with transaction.atomic():
        won = Alert.objects.filter(pk=alert.pk, state=alert.state, version=alert.version).update(
            state=to_state, version=F("version") + 1, resolved_at=now if to_state == AlertState.RESOLVED else None,
            updated_at=timezone.now())
        if won != 1:
            return 0
        alert.refresh_from_db()
        transition = AlertTransition(alert=alert, from_state=from_state, to_state=to_state, at=now, episode=alert.episode, reason=reason)
        if notify:
            event = build_event(alert, None, status="resolved", at=now, diagnosis=alert.diagnosis)
            transition.event_id = uuid.UUID(event["event_id"])
            transition.notified = True
            transition.delivery_ids = _enqueue(alert.project_id, event, alert.severity)
        transition.save()
        metrics.transition_claimed(alert.kind, alert.severity, to_state)
    return 1
