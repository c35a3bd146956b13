"""Regression pages: datasets and runs (progress refreshed while they run), a run's comparison (gate verdicts,
ECDF of both arms per metric, per-bucket tables, per-item deltas linking to each request's waterfall), a
dataset's versions and items, and the forms that start a run and import a dataset (operators). The forms go
through the API's own types (regressions.api) and services, so they give the API's messages."""
from __future__ import annotations

import json
import logging

import numpy as np
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from regressions import service
from regressions.api import NewRun, run_json
from regressions.datasets import FORMATS, DatasetError, parse_file, write_version
from regressions.models import Arm, Dataset, RegressionRun, RunState
from tenancy.models import Project

from .access import Viewer, form_post, page
from .inputs import form_number, refusal_errors, validate
from .views import _base, polled_page

log = logging.getLogger(__name__)
RUN_FIELDS = {"dataset", "target", "baseline", "rate", "max_concurrency", "repetitions", "warmup", "arms"}
ECDF_METRICS = ("ttft_ms", "e2e_ms", "tpot_ms", "queue_ms", "prefill_ms", "decode_ms")
ECDF_POINTS = 200
MAX_UPLOAD = 16 * 1024 * 1024
ITEMS_PER_PAGE = 100


def _run(viewer: Viewer, run_id: int) -> RegressionRun:
    run = RegressionRun.objects.select_related("project", "dataset_version__dataset").filter(
        id=run_id, project_id=viewer.project_id).first()
    if run is None:
        raise Http404("no such run in this project")
    return run


def _page(request: HttpRequest, viewer: Viewer, **extra) -> HttpResponse:
    datasets = []
    for dataset in Dataset.objects.filter(project_id=viewer.project_id).order_by("name"):
        latest = dataset.latest()
        datasets.append({"name": dataset.name, "version": latest.number if latest else None,
                         "items": latest.item_count if latest else 0,
                         "updated": latest.created_at if latest else dataset.created_at})
    runs = [run_json(r) for r in RegressionRun.objects.filter(project_id=viewer.project_id)
            .select_related("project", "dataset_version__dataset").order_by("-id")[:50]]
    active = any(r["state"] in ("queued", "running", "analysing") for r in runs)
    context = {"datasets": datasets, "runs": runs, "formats": FORMATS, "values": {"rate": "inf", "repetitions": 1, "warmup": 0, "arms": "together"}, "errors": {},
               "import_errors": [], **extra}
    return polled_page(request, viewer, "regressions", template="dashboards/regressions.html",
                       partial="dashboards/partials/regression_runs.html", active=active, **context)


@page()
def regressions(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    return _page(request, viewer)


@form_post("operator", "starting a run")
def run_create(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    post = request.POST
    values = {k: post.get(k, "").strip() for k in RUN_FIELDS}
    options = {}
    for key in ("rate", "max_concurrency", "repetitions", "warmup"):
        # "inf" (a rate: all at once) is a float here; the service takes it as the API's "inf"
        value = form_number(values[key], whole=True)
        if value is not None:
            options[key] = value
    if values["arms"]:
        options["arms"] = values["arms"]
    data = {"dataset": values["dataset"], "target": values["target"], "options": options}
    if values["baseline"]:
        data["baseline"] = values["baseline"]
    parsed, errors = validate(NewRun, data, RUN_FIELDS)
    if parsed is None:
        return _page(request, viewer, values=values, errors=errors)
    try:
        run = service.create_run(Project.objects.get(id=viewer.project_id), dataset=parsed.dataset,
                                 target=parsed.target, baseline=parsed.baseline,
                                 options=parsed.options.model_dump(), created_by=viewer.identity.username)
    except service.RunError as exc:
        return _page(request, viewer, values=values, errors=refusal_errors(exc, RUN_FIELDS))
    log.info("regression run %s started from the dashboard by %s", run.id, viewer.identity.username)
    return redirect(reverse("regression-run", args=[run.id]))


@form_post("operator", "importing a dataset")
def dataset_import(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    name = request.POST.get("name", "").strip()
    fmt = request.POST.get("format", "openai")
    upload = request.FILES.get("file")
    problems = []
    if upload is None:
        problems.append("choose a file to import")
    elif upload.size > MAX_UPLOAD:
        problems.append(f"the file is larger than {MAX_UPLOAD // (1024 * 1024)} MiB: import it with "
                        "`manage.py dataset import`")
    if not problems:
        try:
            items = parse_file(upload.read(), fmt)
            version = write_version(Project.objects.get(id=viewer.project_id), name, items,
                                    source=f"dashboard {fmt} {upload.name}"[:200],
                                    created_by=viewer.identity.username)
        except DatasetError as exc:
            problems = exc.problems
    if problems:
        return _page(request, viewer, import_errors=problems, import_values={"name": name, "format": fmt})
    return redirect(reverse("regression-dataset", args=[version.dataset.name]) + f"?version={version.number}")


@page()
def dataset_detail(request: HttpRequest, viewer: Viewer, name: str) -> HttpResponse:
    dataset = Dataset.objects.filter(project_id=viewer.project_id, name=name).first()
    if dataset is None:
        raise Http404("no such dataset in this project")
    versions = list(dataset.versions.order_by("-number"))
    try:
        number = int(request.GET.get("version") or versions[0].number)
    except (ValueError, IndexError):
        raise Http404("no such version") from None
    version = next((v for v in versions if v.number == number), None)
    if version is None:
        raise Http404("no such version of this dataset")
    try:
        offset = max(0, int(request.GET.get("offset", 0)))
    except ValueError:
        offset = 0
    items = [item.as_dict() for item in version.items.order_by("position")[offset: offset + ITEMS_PER_PAGE]]
    for item in items:
        item["preview"] = (item.get("prompt") or (item.get("messages") or [{}])[-1].get("content", ""))[:200]
        item["params_text"] = json.dumps(item["params"]) if item["params"] else ""
        item["evaluators_text"] = ", ".join(e.get("name") or e["type"] for e in item["evaluators"])
    runs = [run_json(r) for r in RegressionRun.objects.filter(dataset_version__dataset=dataset)
            .select_related("project", "dataset_version__dataset").order_by("-id")[:20]]
    return render(request, "dashboards/regression_dataset.html", _base(
        request, viewer, "regressions", dataset=dataset, versions=versions, version=version, items=items,
        offset=offset, next_offset=offset + ITEMS_PER_PAGE if offset + ITEMS_PER_PAGE < version.item_count else None,
        prev_offset=max(0, offset - ITEMS_PER_PAGE) if offset else None, runs=runs))


def _ecdf(base: list[float], cand: list[float]) -> dict:
    """Both arms' empirical CDFs on one grid of at most ECDF_POINTS values (uPlot wants one shared x)."""
    values = np.sort(np.asarray(base + cand, dtype=float))
    if values.size == 0:
        return {"x": [], "baseline": [], "candidate": []}
    grid = np.unique(np.quantile(values, np.linspace(0, 1, min(ECDF_POINTS, values.size))))

    def cdf(sample):
        if not sample:
            return [None] * len(grid)
        s = np.sort(np.asarray(sample, dtype=float))
        return (np.searchsorted(s, grid, side="right") / s.size).round(4).tolist()

    return {"x": grid.round(3).tolist(), "baseline": cdf(base), "candidate": cdf(cand)}


@page()
def run_detail(request: HttpRequest, viewer: Viewer, run_id: int) -> HttpResponse:
    run = _run(viewer, run_id)
    data = run_json(run)
    comparison = run.comparison or {}
    results = list(run.results.filter(warmup=False).order_by("id"))
    baseline_results = [r for r in results if r.arm == Arm.BASELINE]
    if not baseline_results and run.baseline_run_id:
        baseline_results = list(RegressionRun.objects.get(id=run.baseline_run_id).results.filter(
            warmup=False, arm=Arm.CANDIDATE))
    candidate = [r for r in results if r.arm == Arm.CANDIDATE]
    charts = {}
    for metric in ECDF_METRICS:
        base = [r.metrics[metric] for r in baseline_results if r.success and r.metrics.get(metric) is not None]
        cand = [r.metrics[metric] for r in candidate if r.success and r.metrics.get(metric) is not None]
        if base or cand:
            charts[metric] = _ecdf(base, cand)
    by_key = {(r.item_id, r.repetition): r for r in baseline_results}
    deltas = []
    for r in candidate:
        b = by_key.get((r.item_id, r.repetition))
        row = {"item_id": r.item_id, "repetition": r.repetition, "trace_id": r.trace_id, "success": r.success,
               "error": r.error, "passed": r.passed, "bucket": r.prompt_bucket,
               "baseline_trace_id": b.trace_id if b else None}
        for metric in ("ttft_ms", "e2e_ms", "queue_ms"):
            c = r.metrics.get(metric)
            v = b.metrics.get(metric) if b else None
            row[metric] = c
            row[f"{metric}_baseline"] = v
            row[f"{metric}_delta"] = (c - v) if c is not None and v is not None else None
        deltas.append(row)
    sort = request.GET.get("sort") if request.GET.get("sort") in ("ttft_ms", "e2e_ms", "queue_ms") else "e2e_ms"
    deltas.sort(key=lambda d: (d[f"{sort}_delta"] is None, -(d[f"{sort}_delta"] or 0)))
    active = run.state in (RunState.QUEUED, RunState.RUNNING, RunState.ANALYSING)
    return polled_page(request, viewer, "regressions", template="dashboards/regression_run.html",
                       partial="dashboards/partials/regression_progress.html", active=active, run=data,
                       comparison=comparison, charts=charts, deltas=deltas[:200], delta_total=len(deltas), sort=sort)


@form_post("operator", "cancelling a run")
def run_cancel(request: HttpRequest, viewer: Viewer, run_id: int) -> HttpResponse:
    run = _run(viewer, run_id)
    service.cancel(run)
    return redirect(reverse("regression-run", args=[run.id]))
