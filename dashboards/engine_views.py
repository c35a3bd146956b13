"""Engine page: the managed fleet's groups (weights, config versions, models), replicas (state, restarts), the
engine knobs that differ between groups, and small live charts of each replica's vLLM metrics (running and
waiting requests, KV cache usage, speculative decoding acceptance), read from the replicas' own /metrics.

The knob values are the fleet's internals: project admins see them (as GET /api/v1/engine's `detail: full`)."""
from __future__ import annotations

import concurrent.futures
import time
import urllib.request

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from observatory.engine_api import summary_of
from observatory.engine_link import fleet_state
from prometheus_client.parser import text_string_to_metric_families

from .access import Viewer, page
from .views import _base

METRICS_TIMEOUT_S = 1.0
MAX_METRICS_BYTES = 4 * 1024 * 1024


def knob_diff(groups: list[dict]) -> tuple[list[dict], list[dict]]:
    """(knobs whose values differ between the groups, knobs all groups share), each {knob, values by group}."""
    names = [g.get("name") for g in groups]
    configs = [g.get("config") or {} for g in groups]
    knobs = sorted({k for config in configs for k in config})
    differ, same = [], []
    for knob in knobs:
        values = [config.get(knob) for config in configs]
        row = {"knob": knob, "values": [(name, value) for name, value in zip(names, values)]}
        (differ if len({repr(v) for v in values}) > 1 else same).append(row)
    return differ, same


@page()
def engine(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    state = fleet_state()
    fleet = state.get("fleet") or state.get("last_state")
    admin = viewer.can("admin")
    summary = summary_of(fleet)
    differ, same = knob_diff((fleet or {}).get("groups") or []) if admin else ([], [])
    upstreams = {}
    for name, verdict in ((fleet or {}).get("gateway_upstreams") or {}).items() if isinstance(
            (fleet or {}).get("gateway_upstreams"), dict) else []:
        upstreams[name] = verdict
    context = _base(request, viewer, "engine", running=state.get("running", False), summary=summary,
                    error=state.get("error"), differ=differ, same=same, admin=admin, upstreams=upstreams)
    return render(request, "dashboards/engine.html", context)


def _scrape(url: str) -> dict:
    """Running, waiting, KV cache usage and the speculative acceptance rate (since the replica started) of one
    replica, from its Prometheus text; {} when it cannot be read."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=METRICS_TIMEOUT_S) as response:
            text = response.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
    except (OSError, ValueError):
        return {}
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                                   "vllm:spec_decode_num_accepted_tokens_total",
                                   "vllm:spec_decode_num_draft_tokens_total"):
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except ValueError:
        return {}
    drafts = totals.get("vllm:spec_decode_num_draft_tokens_total")
    accepted = totals.get("vllm:spec_decode_num_accepted_tokens_total")
    return {
        "running": totals.get("vllm:num_requests_running"),
        "waiting": totals.get("vllm:num_requests_waiting"),
        "kv_cache": totals.get("vllm:kv_cache_usage_perc"),
        "acceptance": (accepted / drafts) if drafts and accepted is not None else None,
    }


@page()
def engine_metrics(request: HttpRequest, viewer: Viewer) -> JsonResponse:
    """The replicas' current vLLM figures, for the page's live charts (polled every few seconds)."""
    state = fleet_state()
    replicas = [(r.get("name"), r.get("url")) for r in ((state.get("fleet") or {}).get("replicas") or [])
                if r.get("url") and r.get("state") in ("healthy", "unhealthy", "draining")]
    figures = {}
    if replicas:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(replicas))) as pool:
            for (name, _), result in zip(replicas, pool.map(lambda item: _scrape(item[1]), replicas)):
                figures[name] = result
    return JsonResponse({"t": time.time(), "running": bool(state.get("running")), "replicas": figures})
