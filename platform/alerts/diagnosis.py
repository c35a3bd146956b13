"""Why an alert burns: which latency component moved between a baseline and the burning window, which model /
prompt bucket / engine config / replica group carries it, whether vLLM's prefix cache stopped (or started) serving
prompt tokens and when, and what vLLM knob to turn.

`diagnose()` reads ClickHouse (alerts/queries.py) and, best effort, the managed engine's fleet state (the knobs
of each config version) and its replicas' Prometheus metrics (speculative-decoding acceptance);
`build_diagnosis()` and `suggest()` are pure functions of those figures.
"""
from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping

from django.db import transaction
from fleet import replica_metrics
from fleet.state import fleet_state
from traces.store import get_store

from . import queries

log = logging.getLogger(__name__)

COMPONENT_NAMES = {"network_ms": "network", "gateway_ms": "gateway", "overhead_ms": "overhead", "queue_ms": "queue",
                   "prefill_ms": "prefill", "decode_ms": "decode"}
# The components that make up each SLI (TTFT has no decode time; TPOT is decode only).
RELEVANT = {
    "ttft_ms": ("network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms"),
    "tpot_ms": ("decode_ms",),
    "queue_ms": ("queue_ms",),
    "e2e_ms": queries.COMPONENTS,
    "error_ratio": queries.COMPONENTS,
}
LONG_PROMPT_BUCKETS = ("<4k", "<16k", ">=16k")
LONG_PROMPT_TOKENS = 2048
LOW_ACCEPTANCE = 0.3  # below this draft acceptance rate speculative decoding costs more than it saves
MIN_BASELINE_REQUESTS = 10
TOP_N = 3
OUTLIER_BAD_SHARE = 0.5  # a replica group / engine config holding this share of bad events ...
OUTLIER_RATIO = 2.0  # ... and this many times its share of the requests is where the burn is
# The prefix-cache token hit ratio (cached prompt tokens / prompt tokens of the engine-served requests that report
# cached tokens) is compared between the windows when each has this many reporting requests, and said to have moved
# when it changed by at least CACHE_MOVE (10 percentage points: 90 % → 80 % doubles the prompt tokens to prefill).
CACHE_MIN_REQUESTS = 10
CACHE_MOVE = 0.10
CACHE_BUCKET_MIN_REQUESTS = 3  # a bucket of the change-point search with fewer reporting requests is skipped
CACHE_MAX_BUCKETS = 240
CACHE_STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)  # seconds


def diagnose(project_id: int, filters: dict, burning: tuple[dt.datetime, dt.datetime],
             baseline: tuple[dt.datetime, dt.datetime], *, sli: str = "e2e_ms", threshold_ms: float | None = None,
             store=None, engine: Mapping | None = None, include_cached: bool = False) -> dict:
    """The diagnosis of `filters` (service/model/prompt_bucket/engine_config → value or list) for the burning
    window against the baseline window, over engine-served requests (with the response cache's hits too when
    `include_cached`, as the SLO counts). `engine` overrides the fleet lookup (tests, benchmarks)."""
    store = store or get_store()
    stats = queries.window_stats(store, project_id, filters=filters, burning=burning, baseline=baseline,
                                 sli=sli, threshold_ms=threshold_ms, include_cached=include_cached)
    metric = sli if sli in ("e2e_ms", "ttft_ms", "tpot_ms", "queue_ms") else "e2e_ms"
    ranked: dict[str, list[dict]] = {}
    for dimension in queries.CONTRIBUTOR_DIMENSIONS:
        rows = queries.contributors(store, project_id, dimension, filters=filters, burning=burning,
                                    baseline=baseline, metric=metric, sli=sli, threshold_ms=threshold_ms,
                                    include_cached=include_cached)
        ranked[dimension] = rank_contributors(rows)
    if engine is None:
        engine = engine_knobs(
            [c["value"] for c in ranked.get("engine_config", [])[:TOP_N]])
    step = cache_step(burning[1] - baseline[0])
    prefix_cache = prefix_cache_change(queries.prefix_cache_buckets(
        store, project_id, filters=filters, burning=burning, baseline=baseline, step_seconds=step), step, burning[1])
    diagnosis = build_diagnosis(stats, ranked, sli=sli, threshold_ms=threshold_ms, filters=filters,
                                burning=burning, baseline=baseline, engine=engine, prefix_cache=prefix_cache)
    return with_rollouts(diagnosis, project_id, burning)


# How the diagnosis finds the project's rollouts during a window (the rollouts app registers it when installed):
# alerts knows nothing of rollouts.
_rollout_lookups: list[Callable[[int, dt.datetime, dt.datetime], list[dict]]] = []


def register_rollout_lookup(lookup: Callable[[int, dt.datetime, dt.datetime], list[dict]]) -> None:
    """``lookup(project_id, since, until)``: the project's rollouts that ran then, newest first."""
    if lookup not in _rollout_lookups:
        _rollout_lookups.append(lookup)


def with_rollouts(diagnosis: dict, project_id: int, burning: tuple[dt.datetime, dt.datetime]) -> dict:
    """Name the project's rollouts running during the burning window (or ended less than 10 minutes before its
    end): a canary taking traffic is the first suspect of a regression."""
    if not _rollout_lookups:
        return diagnosis
    try:
        # Best effort, in a savepoint: a diagnosis (and the alert transition it belongs to) never fails for want
        # of this lookup.
        with transaction.atomic():
            found = [rollout for lookup in _rollout_lookups for rollout in lookup(project_id, *burning)]
    except Exception:  # noqa: BLE001 - no metadata database here (a benchmark, a unit test), or it is away
        log.warning("diagnosis: the rollouts of project %s could not be read", project_id, exc_info=True)
        return diagnosis
    diagnosis["rollouts"] = found
    if found:
        names = "; ".join(f"rollout #{r['id']} of group {r['group']} ({r['state']}"
                          + (f", canary {r['canary_weight']:g}%" if r["canary_weight"] else "") + ")" for r in found)
        diagnosis["summary"] = f"During {names}. {diagnosis.get('summary') or ''}".strip()
    return diagnosis


def rank_contributors(rows: list[dict]) -> list[dict]:
    """Rows of queries.contributors → one entry per value, ranked by share of the burning window's bad
    events (threshold SLIs) or by contribution to the rise of the overall mean (regressions).

    contribution = share_burning × mean_burning − share_baseline × mean_baseline: the value's term in the
    change of the overall mean, so the contributions of all values add up to that change."""
    by_value: dict[str, dict] = {}
    totals = {w: {"requests": 0, "bad": 0, "observed": 0} for w in queries.WINDOWS}
    for row in rows:
        entry = by_value.setdefault(row["value"], {"value": row["value"]})
        entry[row["window"]] = row
        totals[row["window"]]["requests"] += row["requests"]
        totals[row["window"]]["observed"] += row["observed"]
        totals[row["window"]]["bad"] += row["bad"] or 0
    has_bad = any(row["bad"] is not None for row in rows)
    out = []
    for value, entry in by_value.items():
        burn = entry.get("burning") or {"requests": 0, "bad": 0, "observed": 0, "mean": None}
        base = entry.get("baseline") or {"requests": 0, "bad": 0, "observed": 0, "mean": None}
        term_burn = (burn["observed"] / totals["burning"]["observed"] * burn["mean"]
                     if burn["mean"] is not None and totals["burning"]["observed"] else 0.0)
        term_base = (base["observed"] / totals["baseline"]["observed"] * base["mean"]
                     if base["mean"] is not None and totals["baseline"]["observed"] else 0.0)
        bad = burn["bad"] if has_bad else None
        out.append({
            "value": value,
            "requests": burn["requests"],
            "baseline_requests": base["requests"],
            "bad": bad,
            "bad_share": (bad / totals["burning"]["bad"]) if has_bad and totals["burning"]["bad"] else None,
            "bad_ratio": (bad / burn["requests"]) if has_bad and burn["requests"] else None,
            "mean_ms": burn["mean"],
            "baseline_mean_ms": base["mean"],
            "contribution_ms": term_burn - term_base if totals["baseline"]["observed"] else term_burn,
        })
    if has_bad and totals["burning"]["bad"]:
        out.sort(key=lambda e: (-(e["bad"] or 0), -(e["contribution_ms"] or 0), str(e["value"])))
    else:
        out.sort(key=lambda e: (-(e["contribution_ms"] or 0), -e["requests"], str(e["value"])))
    return out


def build_diagnosis(stats: Mapping[str, dict], ranked: Mapping[str, list[dict]], *, sli: str,
                    threshold_ms: float | None, filters: Mapping, burning, baseline, engine: Mapping | None,
                    prefix_cache: Mapping | None = None) -> dict:
    burn, base = stats["burning"], stats["baseline"]
    have_baseline = base["requests"] >= MIN_BASELINE_REQUESTS
    e2e_burn = burn["figures"]["e2e_ms"]["mean"]
    e2e_base = base["figures"]["e2e_ms"]["mean"]
    components = {}
    for column in queries.COMPONENTS:
        b, a = burn["figures"][column], base["figures"][column]
        components[COMPONENT_NAMES[column]] = {
            "relevant": column in RELEVANT.get(sli, queries.COMPONENTS),
            "burning": {"p50_ms": b["p50"], "p95_ms": b.get("p95"), "mean_ms": b["mean"],
                        "share_of_e2e": _ratio(b["mean"], e2e_burn)},
            "baseline": {"p50_ms": a["p50"], "p95_ms": a.get("p95"), "mean_ms": a["mean"],
                         "share_of_e2e": _ratio(a["mean"], e2e_base)},
            "delta_mean_ms": _delta(b["mean"], a["mean"]) if have_baseline else None,
            "delta_ms": _delta(b["mean"], a["mean"]) if have_baseline else None,  # = delta_mean_ms
            "delta_p50_ms": _delta(b["p50"], a["p50"]) if have_baseline else None,
            "delta_p95_ms": _delta(b.get("p95"), a.get("p95")) if have_baseline else None,
            "delta_share": _delta(_ratio(b["mean"], e2e_burn), _ratio(a["mean"], e2e_base)) if have_baseline else None,
        }
    dominant, why = dominant_component(components, have_baseline)
    hops = {
        name: {"burning_mean_ms": burn["figures"][column]["mean"], "baseline_mean_ms": base["figures"][column]["mean"]}
        for name, column in (("client_gateway", "network_client_gateway_ms"),
                             ("gateway_engine", "network_gateway_engine_ms"))
    }
    top = {dim: entries[:TOP_N] for dim, entries in ranked.items()}
    headline = {dim: entries[0]["value"] for dim, entries in ranked.items() if entries}
    suggestion = suggest(dominant, burn=burn, base=base if have_baseline else None, top=top, hops=hops,
                         engine=engine or {}, prefix_cache=prefix_cache)
    outliers = [found for dim in ("replica_group", "engine_config") if (found := outlier(dim, ranked.get(dim)))]
    if outliers:
        # One is enough: a canary group usually also has its own config, and the group is what can be drained.
        suggestion = {**suggestion, "outlier": outliers[0], "text": f"{suggestion['text']} {outliers[0]['text']}"}
    diagnosis = {
        "sli": sli,
        "threshold_ms": threshold_ms,
        "filters": dict(filters),
        "burning": _window(burning, burn),
        "baseline": _window(baseline, base),
        "baseline_usable": have_baseline,
        "e2e_ms": {"burning": {"p50": burn["figures"]["e2e_ms"]["p50"], "mean": e2e_burn},
                   "baseline": {"p50": base["figures"]["e2e_ms"]["p50"], "mean": e2e_base}},
        "ttft_ms": {"burning": {"p50": burn["figures"]["ttft_ms"]["p50"], "mean": burn["figures"]["ttft_ms"]["mean"]},
                    "baseline": {"p50": base["figures"]["ttft_ms"]["p50"], "mean": base["figures"]["ttft_ms"]["mean"]}},
        "components": components,
        "dominant_component": dominant,
        "dominant_reason": why,
        "network_hops": hops,
        # The prefix cache's token hit ratio before and during the burn, and when it moved; None when no request
        # of either window reported cached prompt tokens.
        "prefix_cache": dict(prefix_cache) if prefix_cache else None,
        # The first value of each dimension, flat (what notifications show), and the top 3 per dimension.
        "top_contributors": [{"dimension": dim, **entries[0]} for dim, entries in top.items() if entries],
        "contributors": top,
        "top": headline,
        "suggestion": suggestion["text"],
        "suggestion_detail": suggestion,
        "engine_knobs_source": (engine or {}).get("source"),
    }
    diagnosis["summary"] = summarise(diagnosis)
    return diagnosis


def dominant_component(components: Mapping[str, dict], have_baseline: bool) -> tuple[str | None, str]:
    """The component that explains the burn: the largest rise of its mean against the baseline among the
    components of the SLI; without a usable baseline, the largest share of the burning window's time."""
    relevant = {name: c for name, c in components.items() if c["relevant"]}
    if have_baseline:
        rises = {name: c["delta_mean_ms"] for name, c in relevant.items() if c["delta_mean_ms"] is not None}
        if rises and max(rises.values()) > 0:
            name = max(rises, key=rises.get)
            c = relevant[name]
            return name, (f"largest rise of the mean: {name} {c['baseline']['mean_ms']:.1f} ms → "
                          f"{c['burning']['mean_ms']:.1f} ms (+{rises[name]:.1f} ms)")
    means = {name: c["burning"]["mean_ms"] for name, c in relevant.items() if c["burning"]["mean_ms"] is not None}
    if not means:
        return None, "no component was observed in the burning window (no engine hop: decomposition unavailable)"
    name = max(means, key=means.get)
    prefix = "no usable baseline; " if not have_baseline else "no component rose; "
    return name, f"{prefix}largest share of the burning window: {name} mean {means[name]:.1f} ms"


def suggest(component: str | None, *, burn: Mapping, base: Mapping | None, top: Mapping[str, list],
            hops: Mapping[str, dict], engine: Mapping, prefix_cache: Mapping | None = None) -> dict:
    """A concrete next step tied to vLLM's knobs for the dominant component."""
    config = (top.get("engine_config") or [{}])[0].get("value") if top.get("engine_config") else None
    knobs = (engine.get("configs") or {}).get(config or "", {})
    where = _where(config, knobs)
    if component == "prefill" and prefix_cache and prefix_cache.get("direction") == "fell":
        return prefix_cache_suggestion(prefix_cache, knobs, where)
    if component == "queue":
        current = knobs.get("max_num_seqs")
        raise_to = f" (now {current}; try {min(max(2 * int(current), 8), 1024)})" if isinstance(current, int) else ""
        groups = knobs.get("groups") or []
        replicas = f" (group {', '.join(groups)}: {knobs.get('replicas')} replica(s))" if groups else ""
        return {
            "component": "queue", "knobs": ["max_num_seqs", "replicas"],
            "text": (f"Requests wait in vLLM's scheduler queue{where}: raise max_num_seqs{raise_to} if the KV cache "
                     f"has room for more concurrent sequences, or add replicas{replicas}."),
        }
    if component == "prefill":
        prompts = burn.get("mean_prompt_tokens")
        bucket = (top.get("prompt_bucket") or [{}])[0].get("value") if top.get("prompt_bucket") else None
        long_prompts = (prompts or 0) >= LONG_PROMPT_TOKENS or bucket in LONG_PROMPT_BUCKETS
        if long_prompts:
            state = ""
            if "enable_chunked_prefill" in knobs:
                state = (f" (now enable_chunked_prefill={knobs['enable_chunked_prefill']}, "
                         f"long_prefill_token_threshold={knobs.get('long_prefill_token_threshold')}, "
                         f"max_num_batched_tokens={knobs.get('max_num_batched_tokens')})")
            return {
                "component": "prefill",
                "knobs": ["enable_chunked_prefill", "long_prefill_token_threshold", "max_num_partial_prefills",
                          "max_num_batched_tokens"],
                "text": (f"Prefill of long prompts dominates{where} (mean {prompts or 0:.0f} prompt tokens"
                         f"{', bucket ' + bucket if bucket else ''}): enable chunked prefill, set "
                         "long_prefill_token_threshold (and max_num_partial_prefills > 1) so long prompts are split "
                         "and cannot block short ones, and size max_num_batched_tokens to the latency target"
                         f"{state}."),
            }
        return {
            "component": "prefill", "knobs": ["max_num_batched_tokens", "enable_prefix_caching", "replicas"],
            "text": (f"Prefill time rose{where} although prompts are short (mean {prompts or 0:.0f} tokens): the GPU is "
                     "saturated by batched work; lower max_num_batched_tokens for latency, keep prefix caching on, "
                     "or add replicas."),
        }
    if component == "decode":
        spec = knobs.get("speculative_config")
        acceptance = (engine.get("acceptance") or {}).get(config or "")
        if spec:
            method = spec.get("method") if isinstance(spec, Mapping) else spec
            if acceptance is not None and acceptance < LOW_ACCEPTANCE:
                return {
                    "component": "decode", "knobs": ["speculative_config"], "acceptance_rate": acceptance,
                    "text": (f"Decode dominates{where} and speculative decoding ({method}) accepts only "
                             f"{acceptance:.0%} of draft tokens (vllm:spec_decode_num_accepted_tokens / "
                             "num_draft_tokens): turn speculative decoding off, or lower num_speculative_tokens."),
                }
            seen = f" (acceptance {acceptance:.0%})" if acceptance is not None else " (acceptance not measured)"
            return {
                "component": "decode", "knobs": ["speculative_config", "max_num_seqs"], "acceptance_rate": acceptance,
                "text": (f"Decode dominates{where} with speculative decoding ({method}) on{seen}: if acceptance is "
                         f"below {LOW_ACCEPTANCE:.0%} turn it off; otherwise lower max_num_seqs to shrink decode "
                         "batches, or add replicas."),
            }
        return {
            "component": "decode", "knobs": ["speculative_config", "max_num_seqs"],
            "text": (f"Decode dominates{where}: enable speculative decoding (speculative_config, e.g. ngram for "
                     "repetitive outputs or an EAGLE draft) to cut time per output token, or lower max_num_seqs to "
                     "shrink decode batches."),
        }
    if component == "network":
        cg = hops["client_gateway"]["burning_mean_ms"]
        ge = hops["gateway_engine"]["burning_mean_ms"]
        if cg is not None and (ge is None or cg >= ge):
            return {
                "component": "network", "knobs": ["gateway placement", "client region"],
                "text": (f"Time between the client and the gateway dominates (mean {cg:.1f} ms): look at the client "
                         "region and the path to the gateway (serve clients from a nearer region)."),
            }
        detail = f" (mean {ge:.1f} ms between gateway and engine)" if ge is not None else ""
        return {
            "component": "network", "knobs": ["gateway max_concurrency / max_queue", "gateway placement"],
            "text": (f"Time outside the engine dominates{detail}: look at the gateway (its admission queue, "
                     "max_concurrency and max_queue, and its placement next to the replicas) or the client region."),
        }
    if component == "gateway":
        return {
            "component": "gateway", "knobs": ["gateway hooks and callbacks", "gateway CPU", "gateway replicas"],
            "text": ("The gateways' own processing dominates (their spans minus their calls to the next hop, e.g. "
                     "LiteLLM's proxy span minus its litellm_request): look at the gateway's pre-call hooks, "
                     "guardrails and logging callbacks, its CPU, and its number of workers or replicas."),
        }
    if component == "overhead":
        return {
            "component": "overhead", "knobs": ["api_server_count", "CPU"],
            "text": (f"vLLM's API-server overhead (tokenisation, detokenisation, HTTP) dominates{where}: give the API "
                     "server more CPU or more API-server processes (--api-server-count), and check CPU throttling."),
        }
    return {"component": None, "knobs": [],
            "text": "No engine-side decomposition in the burning window: check that the engine exports llm_request spans."}


def outlier(dimension: str, entries: list[dict] | None) -> dict | None:
    """The value of `dimension` (replica group or engine config) that holds most of the burning window's bad
    events with a much smaller share of its requests (at least half of the bad events, and twice its share of
    the traffic), when several values served requests: the burn is local to it, so the fix is there and
    traffic can be moved away meanwhile. None otherwise, and for regressions (no bad events to count)."""
    known = [e for e in entries or () if e["value"] not in ("", None) and e["requests"]]
    if len(known) < 2 or known[0]["bad"] is None:
        return None
    bad_total = sum(e["bad"] or 0 for e in known)
    requests_total = sum(e["requests"] for e in known)
    first = known[0]
    if not bad_total or not first["bad"]:
        return None
    bad_share, traffic_share = first["bad"] / bad_total, first["requests"] / requests_total
    if bad_share < OUTLIER_BAD_SHARE or bad_share < OUTLIER_RATIO * traffic_share:
        return None
    others = ", ".join(str(e["value"]) for e in known[1:4])
    if dimension == "replica_group":
        action = (f"compare its engine config with {others}'s and move gateway weight away from it while it is "
                  "investigated (PUT /fleet/weights), or roll it back if it is a canary")
    else:
        action = f"compare it with {others} (engine diff) or roll it back"
    return {
        "dimension": dimension, "value": first["value"], "bad_share": bad_share, "traffic_share": traffic_share,
        "text": (f"The burn is local to {dimension.replace('_', ' ')} {first['value']}: {bad_share:.0%} of the bad "
                 f"events with {traffic_share:.0%} of the requests; {action}."),
    }


def summarise(diagnosis: Mapping) -> str:
    parts = []
    name = diagnosis.get("dominant_component")
    if name:
        c = diagnosis["components"][name]
        b, a = c["burning"], c["baseline"]
        if diagnosis["baseline_usable"] and a["p50_ms"] is not None and b["p50_ms"] is not None:
            parts.append(f"{name} time rose: p50 {a['p50_ms']:.0f} → {b['p50_ms']:.0f} ms, mean "
                         f"{a['mean_ms']:.0f} → {b['mean_ms']:.0f} ms")
        elif b["mean_ms"] is not None:
            share = f" ({b['share_of_e2e']:.0%} of e2e)" if b["share_of_e2e"] is not None else ""
            parts.append(f"{name} time dominates: p50 {b['p50_ms']:.0f} ms, mean {b['mean_ms']:.0f} ms{share}")
        cache = diagnosis.get("prefix_cache") or {}
        if name == "prefill" and cache.get("direction"):
            p95 = f"prefill p95 {c['delta_p95_ms']:+.0f} ms; " if c.get("delta_p95_ms") is not None else ""
            parts.append(p95 + cache_sentence(cache))
    top = diagnosis.get("contributors") or {}
    for dim in ("engine_config", "replica_group", "model", "prompt_bucket"):
        entries = top.get(dim) or []
        if entries and entries[0]["value"] not in ("", None):  # '' = not known (e.g. no replica group said)
            first = entries[0]
            if first.get("bad_share") is not None:
                parts.append(f"top {dim} {first['value']} ({first['bad_share']:.0%} of bad events)")
            else:
                parts.append(f"top {dim} {first['value']}")
    text = "; ".join(parts)
    suggestion = diagnosis.get("suggestion")
    return f"{text}. {suggestion}" if text and suggestion else (suggestion or text)


# -- the prefix cache: its token hit ratio before and during the burn, and when it moved -----------------------------
def cache_step(span: dt.timedelta) -> int:
    """The bucket width (seconds) of the change-point search over `span`: the finest of CACHE_STEPS that keeps
    the search within CACHE_MAX_BUCKETS buckets."""
    seconds = max(span.total_seconds(), 1.0)
    return next((step for step in CACHE_STEPS if seconds / step <= CACHE_MAX_BUCKETS), CACHE_STEPS[-1])


def prefix_cache_change(rows: list[dict], step_seconds: int, until: dt.datetime) -> dict | None:
    """Rows of queries.prefix_cache_buckets → per window the token hit ratio (cached / prompt tokens), the request
    hit ratio (share of requests with any cached token) and the counts behind them; `change` (burning − baseline),
    `direction` ("fell" | "rose" when it moved by CACHE_MOVE or more, with CACHE_MIN_REQUESTS reporting requests
    in each window, else None with the `reason`) and `changed_at`: the start of the first bucket of the last run of
    buckets on the burning window's side of the midpoint between the two ratios (the bucket where it moved and
    stayed moved), None when the latest bucket is not there; `changed_at_text` says it as '14:02 UTC' (with the date
    when not on the day of `until`, the burning window's end). None when no request reported cached tokens."""
    if not rows:
        return None
    keys = ("requests", "prompt_tokens", "cached_tokens", "requests_with_hits")
    windows = {w: dict.fromkeys(keys, 0) for w in queries.WINDOWS}
    series: dict[int, list[int]] = {}
    for row in rows:
        for key in keys:
            windows[row["window"]][key] += row[key]
        cell = series.setdefault(row["bucket"], [0, 0, 0])
        cell[0] += row["requests"]
        cell[1] += row["prompt_tokens"]
        cell[2] += row["cached_tokens"]
    for total in windows.values():
        total["hit_ratio"] = total["cached_tokens"] / total["prompt_tokens"] if total["prompt_tokens"] else None
        total["request_hit_ratio"] = total["requests_with_hits"] / total["requests"] if total["requests"] else None
    base, burn = windows["baseline"], windows["burning"]
    out = {"baseline": base, "burning": burn, "change": None, "direction": None, "changed_at": None,
           "changed_at_text": None, "step_seconds": step_seconds, "min_move": CACHE_MOVE, "reason": ""}
    short = [w for w in queries.WINDOWS
             if windows[w]["requests"] < CACHE_MIN_REQUESTS or not windows[w]["prompt_tokens"]]
    if short:
        out["reason"] = (f"fewer than {CACHE_MIN_REQUESTS} engine-served requests reported cached prompt tokens in "
                         f"the {' and the '.join(short)} window")
        return out
    change = burn["hit_ratio"] - base["hit_ratio"]
    out["change"] = change
    if abs(change) < CACHE_MOVE:
        out["reason"] = (f"the token hit ratio moved {change * 100:+.0f} points, less than the "
                         f"{CACHE_MOVE * 100:.0f} that count")
        return out
    out["direction"] = "fell" if change < 0 else "rose"
    middle = (base["hit_ratio"] + burn["hit_ratio"]) / 2
    changed = None
    for bucket in sorted(series, reverse=True):
        requests, prompt, cached = series[bucket]
        if requests < CACHE_BUCKET_MIN_REQUESTS or not prompt:
            continue
        if (cached / prompt < middle) != (change < 0):
            break
        changed = bucket
    if changed is not None:
        at = dt.datetime.fromtimestamp(changed, dt.timezone.utc)
        out["changed_at"] = _iso(at)
        same_day = at.date() == until.astimezone(dt.timezone.utc).date()
        out["changed_at_text"] = f"{at:%H:%M} UTC" if same_day else f"{at:%Y-%m-%d %H:%M} UTC"
    return out


def cache_sentence(cache: Mapping) -> str:
    """'prefix-cache hit ratio fell from 78 % to 9 % at 14:02 UTC'."""
    text = (f"prefix-cache hit ratio {cache['direction']} from {cache['baseline']['hit_ratio'] * 100:.0f} % to "
            f"{cache['burning']['hit_ratio'] * 100:.0f} %")
    return text + (f" at {cache['changed_at_text']}" if cache.get("changed_at_text") else "")


def prefix_cache_suggestion(cache: Mapping, knobs: Mapping, where: str) -> dict:
    """The next step when prefill rose because vLLM's prefix cache stopped serving the prompts' shared beginning."""
    state = f" (now enable_prefix_caching={knobs['enable_prefix_caching']})" if "enable_prefix_caching" in knobs else ""
    return {
        "component": "prefill", "knobs": ["enable_prefix_caching", "gpu_memory_utilization", "max_num_seqs"],
        "text": (f"Prefill rose{where} because vLLM's prefix cache stopped serving prompt tokens "
                 f"({cache_sentence(cache)}): look at what changed then at the start of the prompts (an edited "
                 "system prompt or template, a timestamp or request ID placed before the shared part) and for a "
                 "deploy that turned "
                 f"enable_prefix_caching off{state}; if neither changed, the KV cache evicts the shared blocks before "
                 "they are reused: give it room (gpu_memory_utilization, a lower max_num_seqs) or send requests that "
                 "share a prefix to the same replica."),
    }


# -- the managed engine: knobs per config version, speculative acceptance ----------------------------------------
def engine_knobs(config_versions: list[str]) -> dict:
    """{"source", "configs": {version: {knobs..., "groups", "replicas"}}, "acceptance": {version: rate}} from
    the managed engine's fleet controller (GET /fleet), best effort: {} when no fleet answers."""
    try:
        state = fleet_state()
    except Exception as exc:  # a missing or broken fleet file must not break an alert
        log.debug("no fleet state for the diagnosis: %s", exc)
        return {}
    fleet = state.get("fleet") or state.get("last_state") or {}
    configs: dict[str, dict] = {}
    upstreams: dict[str, list[str]] = {}
    for group in fleet.get("groups") or []:
        version = group.get("config_version")
        if not version:
            continue
        entry = configs.setdefault(version, {**(group.get("config") or {}), "groups": [], "replicas": 0})
        entry["groups"].append(group.get("name"))
        entry["replicas"] += int(group.get("replicas") or 0)
        upstreams.setdefault(version, []).extend(group.get("upstreams") or [])
    if not configs:
        return {}
    acceptance = {}
    if state.get("running"):
        for version in config_versions:
            if configs.get(version, {}).get("speculative_config"):
                rate = replica_metrics.speculative_acceptance(upstreams.get(version, []))
                if rate is not None:
                    acceptance[version] = rate
    return {"source": "fleet controller" if state.get("running") else "last recorded fleet state",
            "configs": configs, "acceptance": acceptance}


# -- small helpers ---------------------------------------------------------------------------------------------
def _where(config: str | None, knobs: Mapping) -> str:
    if not config:
        return ""
    groups = knobs.get("groups")
    return f" on engine config {config}" + (f" (group {', '.join(groups)})" if groups else "")


def _window(bounds, stats) -> dict:
    return {"since": _iso(bounds[0]), "until": _iso(bounds[1]), "requests": stats["requests"],
            "errors": stats["errors"], "bad": stats["bad"]}


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _ratio(a, b):
    return a / b if a is not None and b else None


def _delta(a, b):
    return a - b if a is not None and b is not None else None
