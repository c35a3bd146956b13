"""Alert pages: firing, pending and resolved alerts; one alert with its diagnosis (component change as
baseline-vs-burning bars, contributors, the suggestion), its transitions and deliveries; silences created from it
and expired (operators), validated by the API's own types."""
from __future__ import annotations

import logging

from alerts.api import SilenceIn, _Muting, alert_json, create_silence, expire_now, silence_json
from alerts.matchers import matches_all
from alerts.models import Alert as AlertRow
from alerts.models import Silence as SilenceRow
from apikit.api import ApiError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods
from loops.models import Loop
from notify.models import Delivery
from tuning.calibration import LIVE_GATED

from engine.sim import traffic_fit as F

from .access import Viewer, page
from .inputs import validate
from .views import _base

log = logging.getLogger(__name__)
STATES = ("firing", "pending", "resolved")
SILENCE_FIELDS = {"matchers", "comment", "duration", "ends_at", "starts_at"}
COMPONENT_ORDER = ("network", "gateway", "overhead", "queue", "prefill", "decode")


@page()
def alert_list(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    state = request.GET.get("state") if request.GET.get("state") in STATES else None
    rows = AlertRow.objects.filter(project_id=viewer.project_id).select_related("project", "slo")
    if state:
        rows = rows.filter(state=state)
    muting = _Muting([viewer.project_id], timezone.now())
    order = {"firing": 0, "pending": 1, "resolved": 2, "inactive": 3}
    alerts = sorted((alert_json(a, muting) for a in rows.order_by("-updated_at", "-id")[:500]),
                    key=lambda a: (order.get(a["state"], 9), -(timezone.datetime.fromisoformat(
                        a["started_at"].replace("Z", "+00:00")).timestamp() if a["started_at"] else 0)))
    now = timezone.now()
    silences = [silence_json(s, now) for s in SilenceRow.objects.filter(project_id=viewer.project_id)
                .select_related("project").order_by("-id")[:100]]
    return render(request, "dashboards/alerts.html", _base(request, viewer, "alerts", alerts=alerts, state=state,
                                                           states=STATES, silences=silences))


def _bars(diagnosis: dict | None) -> list[dict]:
    """The components' mean in the baseline and burning windows, as bar widths (percent of the largest)."""
    components = (diagnosis or {}).get("components") or {}
    items = []
    for name in COMPONENT_ORDER:
        entry = components.get(name)
        if not entry:
            continue
        base = (entry.get("baseline") or {}).get("mean_ms")
        burn = (entry.get("burning") or {}).get("mean_ms")
        items.append({"name": name, "baseline": base, "burning": burn, "delta": entry.get("delta_mean_ms"),
                      "relevant": entry.get("relevant", True)})
    top = max([v for i in items for v in (i["baseline"], i["burning"]) if v is not None] or [1.0]) or 1.0
    for item in items:
        item["baseline_width"] = round(100.0 * max(item["baseline"] or 0.0, 0.0) / top, 2)
        item["burning_width"] = round(100.0 * max(item["burning"] or 0.0, 0.0) / top, 2)
    return items


# An engine model's live error, as the drift alert and the SLI engine_model_error diagnose it: its figures in this
# order, after those a check is judged on (tuning.calibration.LIVE_GATED), which the table puts first.
MODEL_FIGURES = (("prefill_ms_p50", "p50 prefill time"), ("tpot_ms_p50", "p50 TPOT"), ("ttft_ms_p50", "p50 TTFT"),
                 ("prefill_ms_p95", "p95 prefill time"), ("tpot_ms_p95", "p95 TPOT"), ("ttft_ms_p95", "p95 TTFT"),
                 ("queue_ms_p50", "p50 queue time"), ("queue_ms_p95", "p95 queue time"))


def _model_tables(diagnosis: dict | None) -> dict | None:
    """An engine model's diagnosis as two tables (None for a request-component diagnosis): each cost's change at the
    same batch sizes, the one named first marked, and the live error per figure against the bound."""
    d = diagnosis or {}
    if d.get("moved") is None and not d.get("live_error"):
        return None
    changes, live = d.get("moved") or {}, d.get("live_error") or {}
    bound = d.get("bound", d.get("threshold"))
    moved = [{"label": label, "change": changes[cost], "dominant": cost == d.get("dominant_component")}
             for cost, label in F.COSTS.items() if isinstance(changes.get(cost), (int, float))]
    errors = []
    for key, label in sorted(MODEL_FIGURES, key=lambda figure: figure[0] not in LIVE_GATED):  # stable: judged first
        if isinstance(live.get(key), (int, float)):
            judged = key in LIVE_GATED
            errors.append({"label": label, "error": live[key], "judged": judged,
                           "over": judged and bound is not None and abs(live[key]) > bound})
    return {"moved": moved, "errors": errors, "bound": f"{bound:.0%}" if isinstance(bound, (int, float)) else None,
            "engine_model": d.get("engine_model"),
            "group": d.get("group") or (d.get("groups") or [{}])[0].get("group")}


def _alert(viewer: Viewer, fingerprint: str) -> AlertRow:
    alert = (AlertRow.objects.filter(fingerprint=fingerprint, project_id=viewer.project_id)
             .select_related("project", "slo").first())
    if alert is None:
        raise Http404("no such alert in this project")
    return alert


@require_http_methods(["GET", "POST"])
@page()
def alert_detail(request: HttpRequest, viewer: Viewer, fingerprint: str) -> HttpResponse:
    alert = _alert(viewer, fingerprint)
    errors: dict[str, list[str]] = {}
    labels = alert.labels or {}
    default_matchers = "\n".join(f'{k}="{labels[k]}"' for k in ("alertname", "slo", "severity") if k in labels) \
        or "\n".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    values = {"matchers": default_matchers, "duration": "2h", "comment": ""}
    status = 200
    if request.method == "POST":
        viewer.require("operator", "silences", verb="need")
        values = {k: request.POST.get(k, "") for k in ("matchers", "duration", "comment")}
        data = {"matchers": [line.strip() for line in values["matchers"].splitlines() if line.strip()],
                "comment": values["comment"], "duration": values["duration"] or None}
        parsed, errors = validate(SilenceIn, data, SILENCE_FIELDS)
        if not errors:
            try:
                silence = create_silence(viewer.project_id, viewer.identity, parsed, timezone.now())
            except ApiError as exc:
                errors = {"": [exc.message]}
            else:
                log.info("silence %s created by %s in the dashboard", silence.id, viewer.identity.username)
                return redirect(reverse("alert", args=[fingerprint]) + "#silences")
        status = 400
    data = alert_json(alert, _Muting([viewer.project_id], timezone.now()), with_transitions=True)
    delivery_ids = [i for t in data["transitions"] for i in t["delivery_ids"]]
    deliveries = list(Delivery.objects.filter(id__in=delivery_ids, channel__project_id=viewer.project_id)
                      .select_related("channel").order_by("-created_at"))
    now = timezone.now()
    silences = [silence_json(s, now) for s in SilenceRow.objects.filter(project_id=viewer.project_id)
                .select_related("project").order_by("-id")[:200]
                if matches_all(s.parsed_matchers(), labels)]
    loops = list(Loop.objects.filter(project_id=viewer.project_id, alert_fingerprint=fingerprint)
                 .values("id", "group", "state")[:10])
    context = _base(request, viewer, "alerts", alert=data, bars=_bars(data["diagnosis"]), deliveries=deliveries,
                    silences=silences, values=values, errors=errors, loops=loops,
                    model=_model_tables(data["diagnosis"]))
    return render(request, "dashboards/alert.html", context, status=status)


@require_http_methods(["POST"])
@page()
def silence_expire(request: HttpRequest, viewer: Viewer, silence_id: int) -> HttpResponse:
    silence = SilenceRow.objects.filter(pk=silence_id, project_id=viewer.project_id).first()
    if silence is None:
        raise Http404("no such silence in this project")
    viewer.require("operator", "silences", verb="need")
    expire_now(silence, viewer.identity.username, timezone.now())
    log.info("silence %s expired by %s in the dashboard", silence.id, viewer.identity.username)
    back = request.POST.get("next", "")
    return redirect(back if back.startswith("/") and not back.startswith("//") else reverse("alerts"))
