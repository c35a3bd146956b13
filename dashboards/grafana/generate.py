"""Writes the provisioning-ready Grafana dashboards of this directory (`python -m dashboards.grafana.generate`).

- `observatory-platform.json`: the platform's own /metrics: ingest, decomposition lag, SLO state, budget and burn
  rates, alerts, notification deliveries.
- `gateway.json`: the engine gateway's /metrics (`llm_gateway_*`): traffic, overhead, and its response cache (hit
  ratio by kind and per group, lookups by result, misses by reason, lookup time, entries and bytes, evictions,
  stores).
- `vllm.json`: vLLM's /metrics with today's names (vLLM 0.32: `vllm:inter_token_latency_seconds` and
  `vllm:request_time_per_output_token_seconds`, not the removed `vllm:time_per_output_token_seconds`), and each
  per-request mean as rate(_sum) / rate(_count) (vLLM's own example dashboard plots rate(_sum) alone, which is a
  sum of seconds per second, not a latency).
- `caches.json` (dashboards/grafana/caches.py): the request rows' cache figures in the platform's ClickHouse store,
  through Grafana's ClickHouse plugin: the prefix cache's hit ratios over time and by model, service, replica group
  and prompt-length bucket, prefill time per uncached prompt token, the share of requests by what served them.

The JSON files are generated, committed, and checked by tests/dashboards/test_grafana.py (the files equal this
output; every PromQL expression passes `promtool check rules`; every SQL query, expanded as Grafana and the plugin
expand it, returns the rows' figures on a real store). Each takes its data source as the `${datasource}` variable,
so they provision into any Grafana (dashboards/grafana/README.md).
"""
from __future__ import annotations

import json
from pathlib import Path

from .board import PROMETHEUS, Board
from .caches import caches_board

HERE = Path(__file__).resolve().parent


def _variable(name: str, query: str, label: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": PROMETHEUS, "refresh": 2,
            "query": {"query": query, "refId": name}, "definition": query, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {}}


def platform_board() -> dict:
    board = Board("llm-observatory-platform", "LLM observatory: platform", ["llm-observatory"],
                  [_variable("project", "label_values(observatory_slo_state, project)", "Project")])
    board.row("Ingest")
    board.panel("Spans received / accepted / rejected per second", [
        ("sum by (protocol) (rate(observatory_spans_received_total[5m]))", "received {{protocol}}"),
        ("sum by (protocol) (rate(observatory_spans_accepted_total[5m]))", "accepted {{protocol}}"),
        ("sum by (reason) (rate(observatory_spans_rejected_total[5m]))", "rejected: {{reason}}"),
    ], unit="ops")
    board.panel("From arrival to queryable request rows (p50, p95, p99)", [
        (f"histogram_quantile({q}, sum by (le) (rate(observatory_ingest_queryable_lag_seconds_bucket[5m])))", f"p{int(q * 100)}")
        for q in (0.5, 0.95, 0.99)
    ], unit="s")
    board.panel("Backpressure and decomposition backlog", [
        ("max(observatory_ingest_backpressure)", "refusing exports"),
        ("sum(observatory_decompose_pending_traces)", "traces waiting to be decomposed"),
        ("sum(rate(observatory_ingest_backpressure_refusals_total[5m]))", "refusals / s"),
    ])
    board.row("SLOs")
    board.panel("Error budget remaining", [
        ('min by (project, slo) (observatory_slo_error_budget_remaining_ratio{project=~"$project"})', "{{project}}/{{slo}}"),
    ], unit="percentunit", thresholds=[0.0])
    board.panel("Burn rate, 1h window (page tier at 14.4×)", [
        ('max by (project, slo) (observatory_slo_burn_rate{project=~"$project", window="1h"})', "{{project}}/{{slo}}"),
    ], thresholds=[14.4])
    board.panel("Burn rate, 6h window (page tier at 6×)", [
        ('max by (project, slo) (observatory_slo_burn_rate{project=~"$project", window="6h"})', "{{project}}/{{slo}}"),
    ], thresholds=[6.0])
    board.panel("SLOs burning", [
        ('count by (severity) (observatory_slo_state{project=~"$project", state="burning"})', "{{severity}}"),
    ], kind="stat", width=6)
    board.panel("Evaluations and failures per minute", [
        ("sum(rate(observatory_slo_evaluations_total[5m])) * 60", "evaluations"),
        ("sum(rate(observatory_slo_evaluation_failures_total[5m])) * 60", "failures"),
    ], width=9)
    board.panel("Seconds since the last evaluation", [
        ('time() - max by (project, slo) (observatory_slo_last_evaluation_timestamp_seconds{project=~"$project"})',
         "{{project}}/{{slo}}"),
    ], unit="s", width=9, thresholds=[180.0])
    board.row("Alerts and notifications")
    board.panel("Alerts pending and firing", [
        ('sum by (state, severity) (observatory_alerts{state=~"pending|firing"})', "{{state}} {{severity}}"),
    ])
    board.panel("Alert transitions per hour", [
        ("sum by (to, severity) (increase(observatory_alert_transitions_total[1h]))", "→ {{to}} {{severity}}"),
    ])
    board.panel("Deliveries per minute by outcome", [
        ("sum by (kind, outcome) (rate(observatory_notify_deliveries_total[5m])) * 60", "{{kind}} {{outcome}}"),
    ])
    board.panel("Delivery backlog", [
        ("sum by (status) (observatory_notify_backlog_deliveries)", "{{status}}"),
        ("max(observatory_notify_backlog_oldest_due_seconds)", "oldest due (s)"),
    ], width=12)
    board.panel("Delivery attempt latency (p95)", [
        ("histogram_quantile(0.95, sum by (le, kind) (rate(observatory_notify_delivery_attempt_seconds_bucket[5m])))",
         "{{kind}}"),
    ], unit="s", width=12)
    return board.json()


def _mean(metric: str) -> str:
    """A per-request mean over the window: rate(_sum) / rate(_count) (never rate(_sum) alone)."""
    selector = '{model_name=~"$model", engine=~"$engine"}'
    return (f"sum by (model_name) (rate({metric}_sum{selector}[5m])) / "
            f"sum by (model_name) (rate({metric}_count{selector}[5m]))")


def _quantile(metric: str, q: float) -> str:
    return (f'histogram_quantile({q}, sum by (le, model_name) (rate({metric}_bucket{{model_name=~"$model", '
            f'engine=~"$engine"}}[5m])))')


def vllm_board() -> dict:
    selector = '{model_name=~"$model", engine=~"$engine"}'
    board = Board("llm-observatory-vllm", "LLM observatory: vLLM", ["llm-observatory", "vllm"], [
        _variable("model", "label_values(vllm:num_requests_running, model_name)", "Model"),
        _variable("engine", "label_values(vllm:num_requests_running, engine)", "Engine"),
    ])
    board.row("Latency per request")
    for title, metric in (("Time to first token", "vllm:time_to_first_token_seconds"),
                          ("End-to-end latency", "vllm:e2e_request_latency_seconds"),
                          ("Time per output token", "vllm:request_time_per_output_token_seconds"),
                          ("Inter-token latency", "vllm:inter_token_latency_seconds")):
        board.panel(f"{title}: mean, p50, p95, p99", [(_mean(metric), "mean {{model_name}}")] + [
            (_quantile(metric, q), f"p{int(q * 100)} {{{{model_name}}}}") for q in (0.5, 0.95, 0.99)
        ], unit="s", width=12)
    board.row("Where the time goes (mean per request)")
    board.panel("Queue, prefill, decode: mean seconds per request, stacked", [
        (_mean("vllm:request_queue_time_seconds"), "queue {{model_name}}"),
        (_mean("vllm:request_prefill_time_seconds"), "prefill {{model_name}}"),
        (_mean("vllm:request_decode_time_seconds"), "decode {{model_name}}"),
    ], unit="s", width=12, stack=True)
    board.panel("Tokens per request (mean prompt and generation)", [
        (_mean("vllm:request_prompt_tokens"), "prompt {{model_name}}"),
        (_mean("vllm:request_generation_tokens"), "generated {{model_name}}"),
    ], width=12)
    board.row("Load and cache")
    board.panel("Requests running and waiting", [
        (f"sum by (engine) (vllm:num_requests_running{selector})", "running {{engine}}"),
        (f"sum by (engine) (vllm:num_requests_waiting{selector})", "waiting {{engine}}"),
    ])
    board.panel("KV cache usage", [(f"max by (engine) (vllm:kv_cache_usage_perc{selector})", "{{engine}}")],
                unit="percentunit", thresholds=[0.9])
    board.panel("Throughput: tokens per second", [
        (f"sum by (model_name) (rate(vllm:prompt_tokens_total{selector}[5m]))", "prompt {{model_name}}"),
        (f"sum by (model_name) (rate(vllm:generation_tokens_total{selector}[5m]))", "generated {{model_name}}"),
    ])
    board.panel("Prefix cache hit ratio (cached / queried prompt tokens) per replica group", [
        (f"sum by (replica_group) (rate(vllm:prefix_cache_hits_total{selector}[5m])) / "
         f"sum by (replica_group) (rate(vllm:prefix_cache_queries_total{selector}[5m]))", "{{replica_group}}"),
    ], unit="percentunit", description="Per the replica_group label of the scrape target (give each replica's target "
                                       "its group: dashboards/grafana/README.md); one series without it.")
    board.panel("Speculative decoding acceptance (accepted / draft tokens)", [
        (f"sum by (engine) (rate(vllm:spec_decode_num_accepted_tokens_total{selector}[5m])) / "
         f"sum by (engine) (rate(vllm:spec_decode_num_draft_tokens_total{selector}[5m]))", "{{engine}}"),
    ], unit="percentunit")
    board.panel("Preemptions and finished requests per second", [
        (f"sum(rate(vllm:num_preemptions_total{selector}[5m]))", "preemptions"),
        (f"sum by (finished_reason) (rate(vllm:request_success_total{selector}[5m]))", "finished: {{finished_reason}}"),
    ])
    return board.json()


def gateway_board() -> dict:
    group = 'group=~"$group"'
    board = Board("llm-observatory-gateway", "LLM observatory: gateway", ["llm-observatory", "gateway"], [
        _variable("group", "label_values(llm_gateway_requests_total, group)", "Replica group"),
    ])
    board.row("Traffic")
    board.panel("Requests per second by replica group and status", [
        (f"sum by (group, code) (rate(llm_gateway_requests_total{{{group}}}[5m]))", "{{group}} {{code}}"),
    ], unit="reqps")
    board.panel("Gateway overhead per request (p50, p95, p99)", [
        (f"histogram_quantile({q}, sum by (le) (rate(llm_gateway_overhead_seconds_bucket[5m])))", f"p{int(q * 100)}")
        for q in (0.5, 0.95, 0.99)
    ], unit="s")
    board.panel("Arrival to last byte, p95 by replica group", [
        (f"histogram_quantile(0.95, sum by (le, group) (rate(llm_gateway_request_duration_seconds_bucket{{{group}}}"
         "[5m])))", "{{group}}"),
    ], unit="s")
    board.row("Gateway response cache")
    board.panel("Hit ratio by kind (hits / lookups of that kind; semantic looks up exact misses)", [
        (f"sum by (kind) (rate(llm_gateway_cache_lookups_total{{{group}, result=\"hit\"}}[5m])) / "
         f"sum by (kind) (rate(llm_gateway_cache_lookups_total{{{group}}}[5m]))", "{{kind}}"),
        (f"sum(rate(llm_gateway_cache_requests_total{{{group}, result=\"hit\"}}[5m])) / "
         f"sum(rate(llm_gateway_cache_requests_total{{{group}}}[5m]))", "requests answered from the cache"),
    ], unit="percentunit")
    board.panel("Share of requests answered from the cache, by replica group and kind", [
        (f"sum by (group, served_from) (rate(llm_gateway_cache_hits_total{{{group}}}[5m])) / on (group) group_left () "
         f"sum by (group) (rate(llm_gateway_cache_requests_total{{{group}}}[5m]))", "{{group}} {{served_from}}"),
    ], unit="percentunit", description="Of the requests of groups with a response cache.")
    board.panel("Requests by cache result, lookups by kind and result (per second)", [
        (f"sum by (result) (rate(llm_gateway_cache_requests_total{{{group}}}[5m]))", "requests: {{result}}"),
        (f"sum by (kind, result) (rate(llm_gateway_cache_lookups_total{{{group}}}[5m]))", "{{kind}} lookups: {{result}}"),
    ], unit="ops")
    board.panel("Misses by kind and reason (per second)", [
        (f"sum by (kind, reason) (rate(llm_gateway_cache_misses_total{{{group}}}[5m]))", "{{kind}}: {{reason}}"),
    ], unit="ops")
    board.panel("Lookup time by step (p50, p95): exact lookup, embedding call, semantic search", [
        (f"histogram_quantile({q}, sum by (le, kind) (rate(llm_gateway_cache_lookup_seconds_bucket[5m])))",
         f"{{{{kind}}}} p{int(q * 100)}") for q in (0.5, 0.95)
    ], unit="s")
    board.panel("Evictions by kind and reason (per second)", [
        (f"sum by (kind, reason) (rate(llm_gateway_cache_evictions_total{{{group}}}[5m]))", "{{kind}}: {{reason}}"),
    ], unit="ops")
    board.panel("Entries held, by replica group and kind", [
        (f"sum by (group, kind) (llm_gateway_cache_entries{{{group}}})", "{{group}} {{kind}}"),
    ])
    board.panel("Bytes held, by replica group and kind", [
        (f"sum by (group, kind) (llm_gateway_cache_bytes{{{group}}})", "{{group}} {{kind}}"),
    ], unit="bytes")
    board.panel("Answers offered to the cache, by outcome (per second)", [
        (f"sum by (outcome) (rate(llm_gateway_cache_stores_total{{{group}}}[5m]))", "{{outcome}}"),
    ], unit="ops")
    return board.json()


# Over Prometheus (PromQL targets) and over the platform's ClickHouse store (SQL targets of the ClickHouse plugin).
PROMETHEUS_BOARDS = {"observatory-platform.json": platform_board, "gateway.json": gateway_board, "vllm.json": vllm_board}
CLICKHOUSE_BOARDS = {"caches.json": caches_board}
BOARDS = {**PROMETHEUS_BOARDS, **CLICKHOUSE_BOARDS}


def render(name: str) -> str:
    return json.dumps(BOARDS[name](), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    for name in BOARDS:
        (HERE / name).write_text(render(name))
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
