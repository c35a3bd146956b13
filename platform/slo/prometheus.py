"""The same SLOs as Prometheus recording and alerting rules over vLLM's own histograms, as Sloth or Pyrra write them.

Per SLO: one error-ratio recording rule per window (`slo:sli_error:ratio_rate5m` … `ratio_rate3d`, the
period's ratio averaged from the 5-minute one as Sloth does), meta rules (objective, error budget, budget
remaining), and one alert per severity whose expression ORs that severity's multi-window tiers, with the
SLO's traffic guard. Tier suppression across severities is Alertmanager's job: an inhibit rule
(documented in docs/slo.md) mutes `severity="ticket"` while `severity="page"` fires for the same SLO.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import re

import yaml
from prometheus_client.utils import floatToGoString

from engine.replica.metrics import INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

from . import burn, definitions

# SLI → (histogram, its bucket bounds in seconds). TPOT: vLLM's per-request histogram, so the ratio counts
# requests as the platform does (inter_token_latency counts token gaps; --tpot-histogram selects it).
HISTOGRAMS = {
    "ttft_ms": ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
    "tpot_ms": ("vllm:request_time_per_output_token_seconds", INTER_TOKEN_BUCKETS),
    "e2e_ms": ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
    "queue_ms": ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
}
TPOT_HISTOGRAMS = {
    "request_time_per_output_token": "vllm:request_time_per_output_token_seconds",
    "inter_token_latency": "vllm:inter_token_latency_seconds",
}
SUCCESS_COUNTER = "vllm:request_success_total"
ERROR_MATCHER = 'finished_reason="error"'
# Filters with a vLLM metric label; the others (service, prompt_bucket, engine_config, replica_group) exist only
# in traces.
LABEL_FOR_FILTER = {"model": "model_name"}
MODEL_ERROR_SLI = "engine_model_error"  # counts the platform's checks of an engine model: no vLLM series has them
_MATCHER = re.compile(r'^\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*$')


class ExportError(ValueError):
    pass


@dataclasses.dataclass
class Export:
    document: dict
    warnings: list[str]
    skipped: list[str]  # "project/name: why"

    def to_yaml(self) -> str:
        return yaml.dump(self.document, Dumper=_Dumper, sort_keys=False, width=1_000_000, allow_unicode=True)


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks (`expr: |`), as people write rule files."""


def _str(dumper: yaml.SafeDumper, value: str):
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def parse_selector(text: str | None) -> list[str]:
    """'job="vllm",namespace=~"prod-.*"' → ['job="vllm"', 'namespace=~"prod-.*"']."""
    if not text:
        return []
    parts = re.findall(r'[^,"]*"(?:[^"\\]|\\.)*"', text)
    rest = re.sub(r'[^,"]*"(?:[^"\\]|\\.)*"', "", text).replace(",", "").strip()
    if rest or not parts or not all(_MATCHER.match(p) for p in parts):
        raise ExportError(f"--selector takes PromQL label matchers such as job=\"vllm\",namespace=~\"prod-.*\", not {text!r}")
    return [p.strip() for p in parts]


def _regex_escape(value: str) -> str:
    escaped = re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", value)
    return escaped.replace("\\", "\\\\").replace('"', '\\"')


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _matchers(slo, extra: list[str]) -> tuple[list[str], list[str]]:
    """Label matchers for the SLO's filters, and warnings for filters vLLM's metrics cannot express."""
    out = list(extra)
    warnings = []
    for key, values in sorted((slo.filters or {}).items()):
        label = LABEL_FOR_FILTER.get(key)
        if label is None:
            warnings.append(f"{slo.project.name}/{slo.name}: filter {key}={values} has no label in vLLM's metrics; "
                            f"the rules count every request of the selected series (narrow them with --selector)")
            continue
        if len(values) == 1:
            out.append(f'{label}="{_quote(values[0])}"')
        else:
            out.append(f'{label}=~"{"|".join(_regex_escape(v) for v in values)}"')
    return out, warnings


def _selector(matchers: list[str], *more: str) -> str:
    items = [*matchers, *more]
    return "{" + ",".join(items) + "}" if items else ""


def _bucket_bound(slo, metric: str, bounds) -> str:
    seconds = slo.threshold_ms / 1000.0
    for bound in bounds:
        if abs(bound - seconds) <= 1e-9 * max(1.0, bound):
            return floatToGoString(bound)
    below = [b for b in bounds if b < seconds]
    above = [b for b in bounds if b > seconds]
    nearest = []
    if below:
        nearest.append(f"{below[-1] * 1000:g} ms (le=\"{floatToGoString(below[-1])}\")")
    if above:
        nearest.append(f"{above[0] * 1000:g} ms (le=\"{floatToGoString(above[0])}\")")
    raise ExportError(
        f"{slo.project.name}/{slo.name}: threshold {slo.threshold_ms:g} ms is not a bucket bound of {metric}, so "
        f"Prometheus cannot count requests under it exactly; nearest bounds: {' and '.join(nearest)}"
    )


def _threshold_bucket(slo, tpot_metric: str | None) -> tuple[str, str]:
    """The histogram that measures the SLO's latency (``tpot_metric`` for TPOT, when given) and the matcher of its
    bucket at the threshold; ExportError when the threshold is no bucket bound."""
    metric, bounds = HISTOGRAMS[slo.sli]
    if slo.sli == "tpot_ms" and tpot_metric:
        metric = tpot_metric
    return metric, 'le="' + _bucket_bound(slo, metric, bounds) + '"'


def error_ratio_expr(slo, window: str, matchers: list[str], tpot_metric: str | None = None) -> str:
    if slo.sli == "error_ratio":
        sel_all = _selector(matchers)
        sel_err = _selector(matchers, ERROR_MATCHER)
        return (f"sum(rate({SUCCESS_COUNTER}{sel_err}[{window}])) / "
                f"sum(rate({SUCCESS_COUNTER}{sel_all}[{window}]))")
    metric, le_matcher = _threshold_bucket(slo, tpot_metric)
    good = f"sum(rate({metric}_bucket{_selector(matchers, le_matcher)}[{window}]))"
    total = f"sum(rate({metric}_count{_selector(matchers)}[{window}]))"
    return f"1 - ({good} / {total})"


def _guard(slo, window: str, matchers: list[str], tpot_metric: str | None) -> str:
    """The traffic guard over the long window: enough requests and enough bad ones."""
    parts = []
    if slo.sli == "error_ratio":
        total = f"sum(increase({SUCCESS_COUNTER}{_selector(matchers)}[{window}]))"
        bad = f"sum(increase({SUCCESS_COUNTER}{_selector(matchers, ERROR_MATCHER)}[{window}]))"
    else:
        metric, le_matcher = _threshold_bucket(slo, tpot_metric)
        total = f"sum(increase({metric}_count{_selector(matchers)}[{window}]))"
        bad = f"({total} - sum(increase({metric}_bucket{_selector(matchers, le_matcher)}[{window}])))"
    if slo.min_requests:
        parts.append(f"{total} >= {slo.min_requests}")
    if slo.min_bad:
        parts.append(f"{bad} >= {slo.min_bad}")
    return " and on() ".join(f"({p})" for p in parts)


def rules_for(slo, *, extra_matchers: list[str], tpot_metric: str | None = None) -> tuple[list[dict], list[str]]:
    """The rule groups of one SLO and the warnings; ExportError when the SLO cannot be expressed."""
    if slo.sli == MODEL_ERROR_SLI:
        raise ExportError(_model_error_left_out(slo))
    matchers, warnings = _matchers(slo, extra_matchers)
    if slo.include_cached:
        # vLLM's histograms see only what reached it: like the platform's engine SLOs, never a response-cache hit.
        warnings.append(f"{slo.project.name}/{slo.name}: include_cached counts the gateway's response-cache hits, "
                        "which never reach vLLM; these rules count engine-served requests only")
    ident = {"project": slo.project.name, "slo": slo.name}
    tiers = sorted(slo.burn_tiers, key=burn.tier_order)
    period = burn.window_label(slo.period)
    windows = sorted({w for t in tiers for w in (t.long_window, t.short_window)} | {dt.timedelta(minutes=5)})
    labels = [burn.window_label(w) for w in windows if w != slo.period]
    budget = burn.error_budget(slo.objective)
    sli_rules = []
    for label in labels:
        sli_rules.append({
            "record": f"slo:sli_error:ratio_rate{label}",
            "expr": error_ratio_expr(slo, label, matchers, tpot_metric),
            "labels": {**ident, "slo_window": label},
        })
    sel = f'{{project="{_quote(slo.project.name)}",slo="{_quote(slo.name)}"'
    sli_rules.append({
        "record": f"slo:sli_error:ratio_rate{period}",
        # As Sloth: the period's ratio is the mean of the 5-minute ratios (a 30-day rate() is too costly).
        "expr": (f'sum_over_time(slo:sli_error:ratio_rate5m{sel},slo_window="5m"}}[{period}]) / ignoring(slo_window) '
                 f'count_over_time(slo:sli_error:ratio_rate5m{sel},slo_window="5m"}}[{period}])'),
        "labels": {**ident, "slo_window": period},
    })
    meta = [
        {"record": "slo:objective:ratio", "expr": f"vector({slo.objective!r})", "labels": dict(ident)},
        {"record": "slo:error_budget:ratio", "expr": f"vector({budget!r})", "labels": dict(ident)},
        {"record": "slo:current_burn_rate:ratio",
         "expr": f'slo:sli_error:ratio_rate5m{sel},slo_window="5m"}} / on(project, slo) group_left '
                 f"slo:error_budget:ratio{sel}}}",
         "labels": dict(ident)},
        {"record": "slo:period_burn_rate:ratio",
         "expr": f'slo:sli_error:ratio_rate{period}{sel},slo_window="{period}"}} / on(project, slo) group_left '
                 f"slo:error_budget:ratio{sel}}}",
         "labels": dict(ident)},
        {"record": "slo:period_error_budget_remaining:ratio",
         "expr": f"1 - slo:period_burn_rate:ratio{sel}}}", "labels": dict(ident)},
    ]
    alerts = []
    for severity in burn.SEVERITIES:
        chosen = [t for t in tiers if t.severity == severity]
        if not chosen:
            continue
        clauses = []
        for tier in chosen:
            long_label, short_label = burn.window_label(tier.long_window), burn.window_label(tier.short_window)
            threshold = f"({tier.factor!r} * {budget!r})"
            clause = (f'(max(slo:sli_error:ratio_rate{long_label}{sel},slo_window="{long_label}"}}) >= {threshold} '
                      f'and max(slo:sli_error:ratio_rate{short_label}{sel},slo_window="{short_label}"}}) >= {threshold})')
            guard = _guard(slo, long_label, matchers, tpot_metric)
            if guard:
                clause = f"({clause} and on() {guard})"
            clauses.append(clause)
        title = "".join(part.capitalize() for part in re.split(r"[-_]", slo.name))
        alerts.append({
            "alert": f"{title}BurnRate{severity.capitalize()}",
            "expr": "\nor\n".join(clauses),
            "labels": {**ident, "severity": severity, **(slo.labels or {})},
            "annotations": {
                "summary": f"{slo.project.name}/{slo.name}: the error budget burns too fast ({severity})",
                "description": (
                    f"{definitions.format_objective(slo.objective)} of requests must meet "
                    f"{_sli_text(slo)} over {slo.period_days} days; tiers: "
                    + ", ".join(f"{t.name} {t.factor:g}× over {burn.window_label(t.long_window)}/"
                                f"{burn.window_label(t.short_window)}" for t in chosen)
                ),
            },
        })
    base = f"slo-{slo.project.name}-{slo.name}"
    groups = [
        {"name": f"{base}-sli-recordings", "rules": sli_rules},
        {"name": f"{base}-meta-recordings", "rules": meta},
        {"name": f"{base}-alerts", "rules": alerts},
    ]
    return groups, warnings


def _model_error_left_out(slo) -> str:
    return (f"{slo.project.name}/{slo.name}: engine_model_error counts the platform's live checks of the engine model, "
            "which vLLM's metrics do not have: left out (the platform evaluates it; its state and burn rates are on "
            "its /metrics as observatory_slo_*)")


def _sli_text(slo) -> str:
    if slo.sli == "error_ratio":
        return "no error (vLLM finished_reason != error)"
    return f"{slo.sli} ≤ {slo.threshold_ms:g} ms"


# The platform's own health, over its /metrics (docs/ingest.md, "Overload and backpressure"): exports should become
# queryable within seconds; these say when they do not.
INGEST_LAG_P99_SECONDS = 30  # ticket: p99 from arrival to queryable rows over 5 minutes, for 10 minutes
INGEST_STALLED_SECONDS = 300  # page: the oldest accepted export not queryable after 5 minutes, for 5 minutes


def platform_rules(selector: str | None = None) -> dict:
    """The rule group for the platform's own ingest: lag to queryable rows, a stalled backlog, shedding."""
    sel = _selector(parse_selector(selector))
    lag = (f"histogram_quantile(0.99, sum by (le, instance) "
           f"(rate(observatory_ingest_queryable_lag_seconds_bucket{sel}[5m])))")
    return {
        "name": "observatory-platform-ingest",
        "rules": [
            {
                "alert": "ObservatoryIngestLagHigh",
                "expr": f"{lag} > {INGEST_LAG_P99_SECONDS}",
                "for": "10m",
                "labels": {"severity": "ticket"},
                "annotations": {
                    "summary": "LLM observatory: exports take too long to become queryable",
                    "description": (f"p99 from an export's arrival to its request rows is {{{{ $value | humanize }}}}s "
                                    f"(over {INGEST_LAG_P99_SECONDS}s for 10m) on {{{{ $labels.instance }}}}: the "
                                    "decomposition or the ClickHouse writer is behind. See "
                                    "observatory_decompose_pending_traces and observatory_span_writer_blocked_seconds_total."),
                },
            },
            {
                "alert": "ObservatoryIngestStalled",
                "expr": f"max by (instance) (observatory_ingest_backlog_oldest_seconds{sel}) > {INGEST_STALLED_SECONDS}",
                "for": "5m",
                "labels": {"severity": "page"},
                "annotations": {
                    "summary": "LLM observatory: accepted spans are not becoming queryable",
                    "description": ("The oldest accepted export on {{ $labels.instance }} has waited "
                                    "{{ $value | humanizeDuration }} (ClickHouse unreachable, or the decomposition "
                                    "stuck): requests and SLOs are stale. The data is safe in the spool."),
                },
            },
            {
                "alert": "ObservatoryIngestShedding",
                "expr": f"sum by (instance) (rate(observatory_ingest_backpressure_refusals_total{sel}[5m])) > 0",
                "for": "15m",
                "labels": {"severity": "ticket"},
                "annotations": {
                    "summary": "LLM observatory: ingest refuses exports (overloaded)",
                    "description": ("{{ $labels.instance }} has answered 503 / UNAVAILABLE to exports for 15m "
                                    "because its backlog is beyond INGEST_BACKLOG_MAX_BYTES / _SECONDS: exporters "
                                    "retry, but sustained refusals mean spans will be dropped by clients. Add "
                                    "capacity or reduce sampling."),
                },
            },
        ],
    }


def export(slos, *, selector: str | None = None, tpot_histogram: str = "request_time_per_output_token",
           platform: bool = True, platform_selector: str | None = None) -> Export:
    """Rules for these SLOs (and, with `platform`, the platform's own ingest). SLOs that cannot be
    expressed are listed in `skipped` with the reason."""
    extra = parse_selector(selector)
    if tpot_histogram not in TPOT_HISTOGRAMS:
        raise ExportError(f"--tpot-histogram takes {' or '.join(TPOT_HISTOGRAMS)}")
    tpot_metric = TPOT_HISTOGRAMS[tpot_histogram]
    groups, warnings, skipped = [], [], []
    for slo in slos:
        if not slo.enabled:
            warnings.append(f"{slo.project.name}/{slo.name}: disabled, not exported")
            continue
        if slo.sli == MODEL_ERROR_SLI:  # never expressible: not a failure of the export, as a disabled SLO
            warnings.append(_model_error_left_out(slo))
            continue
        try:
            slo_groups, slo_warnings = rules_for(slo, extra_matchers=extra, tpot_metric=tpot_metric)
        except ExportError as exc:
            skipped.append(str(exc))
            continue
        groups.extend(slo_groups)
        warnings.extend(slo_warnings)
    if platform:
        groups.append(platform_rules(platform_selector))
    return Export({"groups": groups}, warnings, skipped)
