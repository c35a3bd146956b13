"""The dashboard's pages: overview, requests explorer, trace detail."""
from __future__ import annotations

import datetime as dt
import re
from concurrent.futures import ThreadPoolExecutor

from django import forms
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from rollouts.service import annotations
from traces import cache_queries
from traces import queries as trace_queries
from traces.store import get_store

from collectors.base import CACHE_CLASSES, SERVED_FROM

from . import queries
from .access import Viewer, page
from .nav import PAGES

TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")


class RangeField(forms.ChoiceField):
    def __init__(self, **kwargs):
        super().__init__(choices=[(k, k) for k in queries.RANGES], required=False, **kwargs)


def _range(value: str | None) -> tuple[str, dt.datetime, dt.datetime, int]:
    label = value if value in queries.RANGES else queries.DEFAULT_RANGE
    seconds, step = queries.RANGES[label]
    until = dt.datetime.now(dt.timezone.utc)
    return label, until - dt.timedelta(seconds=seconds), until, step


def _base(request: HttpRequest, viewer: Viewer, section: str, **context) -> dict:
    context.update(viewer=viewer, section=section, ranges=list(queries.RANGES), nav=PAGES)
    return context


def polled_page(request: HttpRequest, viewer: Viewer, section: str, *, template: str, partial: str, active: bool,
                reload_when_done: bool = True, **context) -> HttpResponse:
    """A page whose `partial` htmx polls while something on it is `active` (a run, a study, a rollout): htmx's
    requests get the partial, and with `reload_when_done` an HX-Refresh once nothing is active any more (the whole
    page reloads once, with what only an ended job shows, and stops polling); others get the whole page."""
    context = _base(request, viewer, section, active=active, **context)
    if request.headers.get("HX-Request"):
        response = render(request, partial, context)
        if reload_when_done and not active:
            response["HX-Refresh"] = "true"
        return response
    return render(request, template, context)


# -- overview --------------------------------------------------------------------------------------------------
ENGINE_SERVED = {"served_from": "engine"}


# The overview's independent store queries run side by side (each worker thread keeps its own store client, and the
# store runs queries from several clients at once): the page waits for the slowest, not for their sum.
_QUERIES = ThreadPoolExecutor(max_workers=3, thread_name_prefix="overview-query")


def _engine_breakdowns(store, project_id: int, since: dt.datetime, until: dt.datetime) -> list[dict]:
    return trace_queries.latency_summary(store, project_id, since=since, until=until,
                                         group_by=list(queries.BREAKDOWNS), filters=ENGINE_SERVED, separately=True,
                                         metrics=trace_queries.TAIL_METRICS)


def _breakdowns(engine_groups: list[dict], caches: dict[str, dict[str, dict]]) -> dict[str, list[dict]]:
    """Per dimension, one row per value: all its requests and errors, the share a response cache served, the
    prefix cache's hit ratios and prefill per computed token, and the engine-served requests' percentiles."""
    engine: dict[tuple[str, str], dict] = {}
    for group in engine_groups:
        [(dimension, value)] = group["key"].items()
        engine[(dimension, value)] = group
    breakdowns = {}
    order = {bucket: i for i, bucket in enumerate(queries.PROMPT_BUCKETS)}
    for dimension in queries.BREAKDOWNS:
        groups = []
        for value, figures in caches[dimension].items():
            group = {"key": {dimension: value}, "count": figures["requests"], "errors": figures["errors"],
                     "cache": figures}
            for metric in trace_queries.TAIL_METRICS:
                group[metric] = engine.get((dimension, value), {}).get(metric, {})
            groups.append(group)
        if dimension == "prompt_bucket":
            groups.sort(key=lambda g: order.get(g["key"]["prompt_bucket"], 99))
        else:
            groups.sort(key=lambda g: (-g["count"], g["key"][dimension]))
        breakdowns[dimension] = groups
    return breakdowns


def _classes(store, project_id: int, since: dt.datetime, until: dt.datetime) -> list[dict]:
    """What served the range's requests (the engine, the gateway's exact and semantic caches): each class's count,
    share, e2e and TTFT p50, and for a cache class the latency it saved: the engine-served p50 e2e minus its own,
    per request and times its requests. (Asked only when a cache served some: a summary of the range.)"""
    found = {g["key"]["served_from"]: g for g in trace_queries.latency_summary(
        store, project_id, since=since, until=until, group_by=["served_from"], filters={},
        metrics=("e2e_ms", "ttft_ms"))}
    engine_p50 = found.get("engine", {}).get("e2e_ms", {}).get("p50")
    total = sum(g["count"] for g in found.values())  # of this summary (rows keep arriving while a page is built)
    classes = []
    for name in SERVED_FROM:
        group = found.get(name)
        count = group["count"] if group else 0
        e2e = group["e2e_ms"]["p50"] if group else None
        saved = cache_queries.latency_saved(engine_p50, e2e) if name != "engine" else None
        classes.append({"name": name, "count": count, "share": count / total if total else None, "e2e_p50": e2e,
                        "ttft_p50": group["ttft_ms"]["p50"] if group else None, "saved_ms": saved,
                        "saved_total_s": saved * count / 1000 if saved is not None else None})
    return classes


@page()
def overview(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    label, since, until, step = _range(request.GET.get("range"))
    store = get_store()
    project_id = viewer.project_id
    series_job = _QUERIES.submit(queries.overview_series, store, project_id, since, until, step)
    caches_job = _QUERIES.submit(queries.breakdown_caches, store, project_id, since, until)
    engine_job = _QUERIES.submit(_engine_breakdowns, store, project_id, since, until)
    caches = caches_job.result()
    whole = caches["all"].get("") or {}
    classes_job = _QUERIES.submit(_classes, store, project_id, since, until) if whole.get("cache_served") else None
    breakdowns = _breakdowns(engine_job.result(), caches)
    groups = [g["key"]["replica_group"] for g in breakdowns["replica_group"] if g["key"]["replica_group"]]
    comparison = None
    if len(groups) > 1:
        comparison = {
            "groups": [g for g in breakdowns["replica_group"] if g["key"]["replica_group"]],
            # From a day up, hourly points: the per-group rollup totals answer them (the raw rows of a day, per
            # group, cost as much as the whole chart set).
            "series": queries.group_series(store, project_id, since, until,
                                           3600 if until - since >= dt.timedelta(hours=24) else step, groups),
        }
    series = series_job.result()
    series["annotations"] = annotations(project_id, since, until)
    total = sum(series["rate"]) * step
    errors = sum(series["errors"]) * step
    classes = classes_job.result() if classes_job is not None else None
    context = _base(request, viewer, "overview", range=label, step=step, series=series, breakdowns=breakdowns,
                    comparison=comparison, total=int(round(total)), errors=int(round(errors)),
                    error_rate=(errors / total) if total else None, caches=whole, classes=classes,
                    since=since, until=until)
    template = "dashboards/partials/overview_body.html" if request.headers.get("HX-Request") else \
        "dashboards/overview.html"
    return render(request, template, context)


# -- requests explorer -----------------------------------------------------------------------------------------
class ExplorerForm(forms.Form):
    range = RangeField()
    model = forms.CharField(required=False, max_length=256, widget=forms.TextInput(attrs={"list": "model-values"}))
    service = forms.CharField(required=False, max_length=256, widget=forms.TextInput(attrs={"list": "service-values"}))
    engine_config = forms.CharField(required=False, max_length=256,
                                    widget=forms.TextInput(attrs={"list": "engine_config-values"}))
    replica_group = forms.CharField(required=False, max_length=256,
                                    widget=forms.TextInput(attrs={"list": "replica_group-values"}))
    prompt_bucket = forms.ChoiceField(required=False, choices=[("", "any")] + [(b, b) for b in queries.PROMPT_BUCKETS])
    status = forms.ChoiceField(required=False, choices=[("", "any"), ("ok", "ok"), ("error", "error")])
    served_from = forms.ChoiceField(required=False, label="Served from",
                                    choices=[("", "any")] + [(s, s.replace("_", " ")) for s in SERVED_FROM])
    min_e2e = forms.FloatField(required=False, min_value=0, max_value=1e9, label="min e2e (ms)")
    min_ttft = forms.FloatField(required=False, min_value=0, max_value=1e9, label="min TTFT (ms)")
    sort = forms.ChoiceField(required=False, choices=[(k, k) for k in queries.SORTS])
    order = forms.ChoiceField(required=False, choices=[("desc", "desc"), ("asc", "asc")])
    after = forms.CharField(required=False, max_length=200)

    def clean_after(self):
        value = self.cleaned_data.get("after") or ""
        if not value:
            return None
        try:
            return queries.Cursor.decode(value)
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


@page()
def requests_explorer(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    form = ExplorerForm(request.GET or None, initial={"range": queries.DEFAULT_RANGE, "sort": "start_time",
                                                      "order": "desc"})
    rows: list = []
    following = None
    label = queries.DEFAULT_RANGE
    sort, descending = "start_time", True
    if form.is_bound and not form.is_valid():
        status = 400
    else:
        status = 200
        data = form.cleaned_data if form.is_bound else {}
        label, since, until, _ = _range(data.get("range"))
        sort = data.get("sort") or "start_time"
        descending = (data.get("order") or "desc") == "desc"
        filters = {name: data[name] for name in queries.EXPLORER_FILTERS if data.get(name)}
        rows, following = queries.explore(get_store(), viewer.project_id, since=since, until=until, filters=filters,
                                          min_e2e=data.get("min_e2e"), min_ttft=data.get("min_ttft"), sort=sort,
                                          descending=descending, after=data.get("after"))
    query = request.GET.copy()
    query.pop("after", None)
    next_url = None
    if following is not None:
        query["after"] = following.encode()
        next_url = f"{reverse('requests')}?{query.urlencode()}"
    first = request.GET.copy()
    first.pop("after", None)
    sort_links = {}
    for column in queries.SORTS:
        link = first.copy()
        link["sort"] = column
        link["order"] = "asc" if column == sort and descending else "desc"
        sort_links[column] = f"{reverse('requests')}?{link.urlencode()}"
    suggestions = queries.distinct_values(get_store(), viewer.project_id, *_range(label)[1:3])
    context = _base(request, viewer, "requests", form=form, rows=rows, next_url=next_url, range=label, sort=sort,
                    suggestions=suggestions,
                    descending=descending, sort_links=sort_links, paged=bool(request.GET.get("after")),
                    first_url=f"{reverse('requests')}?{first.urlencode()}")
    template = "dashboards/partials/requests_table.html" if request.headers.get("HX-Request") else \
        "dashboards/requests.html"
    return render(request, template, context, status=status)


# -- trace detail ----------------------------------------------------------------------------------------------
ROLE_ORDER = {"client": 0, "gateway": 1, "engine": 2}
# The figures of a request row: an engine-served one's, and a cache-served one's (docs/decomposition.md, "Caches":
# its gateway stands in for the engine, e2e = network + gateway + lookup + overhead; no queue, prefill or decode).
ENGINE_FIGURES = ("e2e_ms", "ttft_ms", "engine_ttft_ms", "tpot_ms", "network_ms", "gateway_ms", "overhead_ms",
                  "queue_ms", "prefill_ms", "decode_ms")
CACHE_FIGURES = ("e2e_ms", "ttft_ms", "network_ms", "gateway_ms", "lookup_ms", "overhead_ms")


def _parts(row: dict, hop: dict, serves_from_cache: bool) -> list[tuple[str, float | None]] | None:
    """The parts a hop's bar is split into, in time order, before the rest of it (overhead): the engine's queue,
    prefill and decode; the lookup of the gateway that answered from its response cache (NULL: none reported, the
    whole bar is its own time). None: the bar is not split."""
    if hop["role"] == "engine":
        return [(name[:-3], row.get(name)) for name in ("queue_ms", "prefill_ms", "decode_ms")]
    if serves_from_cache:
        return [("lookup", row.get("lookup_ms") or 0.0)]
    return None


def waterfall(row: dict) -> dict:
    """Bars of one request's hops on one time axis (percent of the axis): each hop's span, the engine's queue,
    prefill, decode and overhead (or, for a request answered from a gateway's response cache, that gateway's
    lookup and overhead), the network between hops (the gap from a hop's start to the next one's, and from the
    next one's end back to its end)."""
    hops = row["hops"]
    if not hops:
        return {"bars": [], "span_ms": 0}
    start = min(h["start_ns"] for h in hops)
    end = max(h["start_ns"] + h["duration_ms"] * 1e6 for h in hops)
    total = max(end - start, 1.0)

    def pct(ns: float) -> float:
        return round(100.0 * ns / total, 4)

    cached = row.get("served_from") in CACHE_CLASSES  # then the innermost hop is the gateway that answered
    bars = []
    for index, hop in enumerate(hops):
        left_ns = hop["start_ns"] - start
        width_ns = hop["duration_ms"] * 1e6
        bar = {"hop": hop, "left": pct(left_ns), "width": pct(width_ns), "segments": [], "gaps": [],
               "server": cached and index == len(hops) - 1}
        parts = _parts(row, hop, bar["server"])
        if parts is not None:
            cursor = left_ns
            for name, value in parts:
                if value is None:
                    continue
                bar["segments"].append({"name": name, "ms": value, "left": pct(cursor),
                                        "width": pct(max(value, 0.0) * 1e6)})
                cursor += max(value, 0.0) * 1e6
            if bar["segments"]:
                rest = hop["start_ns"] - start + width_ns - cursor
                if rest > 0:
                    bar["segments"].append({"name": "overhead", "ms": rest / 1e6, "left": pct(cursor),
                                            "width": pct(rest)})
        if index > 0:
            upper = hops[index - 1]
            before = hop["start_ns"] - upper["start_ns"]
            after = (upper["start_ns"] + upper["duration_ms"] * 1e6) - (hop["start_ns"] + width_ns)
            if before > 0:
                bar["gaps"].append({"left": pct(upper["start_ns"] - start), "width": pct(before), "ms": before / 1e6})
            if after > 0:
                bar["gaps"].append({"left": pct(hop["start_ns"] - start + width_ns), "width": pct(after),
                                    "ms": after / 1e6})
        bars.append(bar)
    return {"bars": bars, "span_ms": total / 1e6, "ticks": [round(total / 1e6 * f / 4, 1) for f in range(5)],
            "cached": cached}


@page()
def trace_detail(request: HttpRequest, viewer: Viewer, trace_id: str) -> HttpResponse:
    if not TRACE_ID.match(trace_id):
        raise Http404("a trace id is 32 hexadecimal characters")
    trace_id = trace_id.lower()
    store = get_store()
    rows = trace_queries.requests_for_trace(store, viewer.project_id, trace_id)
    if not rows:
        raise Http404("no request of this trace in this project")
    span_ids = [hop["span_id"] for row in rows for hop in row["hops"]]
    traces = {trace_id} | {hop.get("trace_id") or row["trace_id"] for row in rows for hop in row["hops"]}
    spans = queries.spans_of(store, viewer.project_id, sorted(traces), span_ids)
    requests = []
    for row in rows:
        for hop in row["hops"]:
            hop["span"] = spans.get(hop["span_id"])
        names = CACHE_FIGURES if row.get("served_from") in CACHE_CLASSES else ENGINE_FIGURES
        requests.append({"row": row, "waterfall": waterfall(row),
                         "figures": [(name, row.get(name)) for name in names]})
    context = _base(request, viewer, "requests", trace_id=trace_id, requests=requests)
    return render(request, "dashboards/trace.html", context)
