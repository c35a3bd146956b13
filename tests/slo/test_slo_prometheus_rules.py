"""`manage.py export_prometheus_rules`: recording + alerting rules over vLLM's histograms that `promtool check rules`
accepts and that fire, in `promtool test rules` with synthetic vLLM series, exactly when the platform's tiers would.
The promtool parts are skipped (with the reason) when promtool is not installed (Debian: apt-get install prometheus)."""
from __future__ import annotations

import io
import shutil
import subprocess
import textwrap

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import CommandError
from slo import services
from tenancy.models import Project

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


@pytest.fixture
def alpha(db):
    project = Project.objects.create(name="alpha")
    services.create(project.id, {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%",
                                 "filters": {"model": "m-8b", "service": "chat-app"}, "labels": {"team": "serving"}})
    services.create(project.id, {"name": "errors", "sli": "error_ratio", "objective": "99.9%", "period": "28d"})
    services.create(project.id, {"name": "queue", "sli": "queue_ms", "threshold_ms": 1000, "objective": "95%",
                                 "filters": {"model": ["m-8b", "m.70b"]},
                                 "tiers": [{"name": "page-6h", "severity": "page", "long_window": "6h",
                                            "short_window": "30m", "factor": 6}]})
    services.create(project.id, {"name": "tpot", "sli": "tpot_ms", "threshold_ms": 50, "objective": "99.5%"})
    services.create(project.id, {"name": "e2e", "sli": "e2e_ms", "threshold_ms": 10000, "objective": "99%",
                                 "enabled": False})
    return project


def export(*args) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("export_prometheus_rules", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_rules_per_window_meta_and_one_alert_per_severity(alpha):
    text, warnings = export()
    document = yaml.safe_load(text)
    names = [g["name"] for g in document["groups"]]
    assert names[:3] == ["slo-alpha-chat-ttft-sli-recordings", "slo-alpha-chat-ttft-meta-recordings",
                         "slo-alpha-chat-ttft-alerts"]
    assert not any("slo-alpha-e2e" in n for n in names)  # disabled
    assert "alpha/e2e: disabled, not exported" in warnings
    assert "alpha/chat-ttft: filter service=['chat-app'] has no label in vLLM's metrics" in warnings
    groups = {g["name"]: g["rules"] for g in document["groups"]}
    sli = groups["slo-alpha-chat-ttft-sli-recordings"]
    assert [r["labels"]["slo_window"] for r in sli] == ["5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d"]
    assert all(r["record"] == f"slo:sli_error:ratio_rate{r['labels']['slo_window']}" for r in sli)
    assert sli[0]["expr"] == (
        '1 - (sum(rate(vllm:time_to_first_token_seconds_bucket{model_name="m-8b",le="0.5"}[5m])) / '
        'sum(rate(vllm:time_to_first_token_seconds_count{model_name="m-8b"}[5m])))'
    )
    assert "sum_over_time(slo:sli_error:ratio_rate5m" in sli[-1]["expr"]
    alerts = groups["slo-alpha-chat-ttft-alerts"]
    assert [a["alert"] for a in alerts] == ["ChatTtftBurnRatePage", "ChatTtftBurnRateTicket"]
    assert alerts[0]["labels"] == {"project": "alpha", "slo": "chat-ttft", "severity": "page", "team": "serving"}
    page = alerts[0]["expr"]
    assert '>= (14.4 * 0.01)' in page and '>= (6.0 * 0.01)' in page
    assert 'sum(increase(vllm:time_to_first_token_seconds_count{model_name="m-8b"}[1h])) >= 20' in page
    # error ratio: vLLM's finished_reason; queue: two models as an escaped regex; TPOT: per-request histogram
    errors = groups["slo-alpha-errors-sli-recordings"][0]["expr"]
    assert errors == ('sum(rate(vllm:request_success_total{finished_reason="error"}[5m])) / '
                      'sum(rate(vllm:request_success_total[5m]))')
    assert groups["slo-alpha-errors-sli-recordings"][-1]["labels"]["slo_window"] == "28d"
    queue = groups["slo-alpha-queue-sli-recordings"][0]["expr"]
    assert 'vllm:request_queue_time_seconds_bucket{model_name=~"m-8b|m\\\\.70b",le="1.0"}' in queue
    assert [a["alert"] for a in groups["slo-alpha-queue-alerts"]] == ["QueueBurnRatePage"]
    assert "vllm:request_time_per_output_token_seconds_bucket{le=\"0.05\"}" in groups["slo-alpha-tpot-sli-recordings"][0]["expr"]
    text, _ = export("--tpot-histogram", "inter_token_latency", "--selector", 'job="vllm",namespace=~"prod-.*"')
    tpot = {g["name"]: g["rules"] for g in yaml.safe_load(text)["groups"]}["slo-alpha-tpot-sli-recordings"][0]
    assert 'vllm:inter_token_latency_seconds_bucket{job="vllm",namespace=~"prod-.*",le="0.05"}' in tpot["expr"]


def test_a_threshold_between_bucket_bounds_is_refused_naming_the_nearest(alpha, tmp_path):
    services.create(alpha.id, {"name": "ttft-300", "sli": "ttft_ms", "threshold_ms": 300, "objective": "99%"})
    out = tmp_path / "rules.yaml"
    with pytest.raises(CommandError) as info:
        export("--out", str(out))
    assert ("alpha/ttft-300: threshold 300 ms is not a bucket bound of vllm:time_to_first_token_seconds, so "
            "Prometheus cannot count requests under it exactly; nearest bounds: 250 ms (le=\"0.25\") and "
            "500 ms (le=\"0.5\")") in str(info.value)
    assert not out.exists()
    _, err = export("--out", str(out), "--skip-unexportable")
    assert "skipped: alpha/ttft-300: threshold 300 ms" in err
    assert "slo-alpha-ttft-300" not in out.read_text() and "slo-alpha-chat-ttft" in out.read_text()


def test_an_slo_that_counts_response_cache_hits_is_exported_with_a_warning(alpha):
    """vLLM's histograms never see a response-cache hit: the rules of an include_cached SLO count engine-served
    requests only, and the command says so."""
    services.create(alpha.id, {"name": "seen-ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%",
                               "include_cached": True})
    text, warnings = export()
    assert "slo-alpha-seen-ttft-alerts" in [g["name"] for g in yaml.safe_load(text)["groups"]]
    assert ("alpha/seen-ttft: include_cached counts the gateway's response-cache hits, which never reach vLLM; "
            "these rules count engine-served requests only") in warnings
    assert "chat-ttft: include_cached" not in warnings


def test_project_selection_and_bad_options(alpha):
    beta = Project.objects.create(name="beta")
    services.create(beta.id, {"name": "b-errors", "sli": "error_ratio", "objective": "99%"})
    text, _ = export("--project", "beta")
    assert [g["name"] for g in yaml.safe_load(text)["groups"]][0] == "slo-beta-b-errors-sli-recordings"
    assert "alpha" not in text
    with pytest.raises(CommandError, match="no project named gamma"):
        export("--project", "gamma")
    with pytest.raises(CommandError, match="--selector takes PromQL label matchers"):
        export("--selector", "job=vllm")


@needs_promtool
def test_promtool_accepts_the_rules(alpha, tmp_path):
    out = tmp_path / "rules.yaml"
    export("--out", str(out), "--selector", 'job="vllm"')
    result = subprocess.run([PROMTOOL, "check", "rules", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_test_pages_on_a_fast_burn_and_stays_quiet_when_healthy(alpha, tmp_path):
    rules = tmp_path / "rules.yaml"
    export("--out", str(rules), "--project", "alpha")
    alerts = {r["alert"]: r for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"] if "alert" in r}
    page, ticket = alerts["ChatTtftBurnRatePage"], alerts["ChatTtftBurnRateTicket"]
    # chat-ttft (99%, TTFT ≤ 500 ms, model m-8b): 100 requests a minute; 20% over 500 ms is a 20× burn.
    # The healthy model m-70b is not selected by the SLO's model filter.
    tests = textwrap.dedent(f"""\
        rule_files: [{rules}]
        evaluation_interval: 1m
        tests:
          - interval: 1m
            input_series:
              - series: 'vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m-8b",engine="0"}}'
                values: '0+80x180'
              - series: 'vllm:time_to_first_token_seconds_count{{model_name="m-8b",engine="0"}}'
                values: '0+100x180'
              - series: 'vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m-70b",engine="0"}}'
                values: '0+1000x180'
              - series: 'vllm:time_to_first_token_seconds_count{{model_name="m-70b",engine="0"}}'
                values: '0+1000x180'
            alert_rule_test:
              - eval_time: 70m
                alertname: ChatTtftBurnRatePage
                exp_alerts:
                  - exp_labels: {yaml.safe_dump(page["labels"], default_flow_style=True).strip()}
                    exp_annotations: {yaml.safe_dump(page["annotations"], default_flow_style=True, width=1000,
                                                     allow_unicode=True).strip()}
              - eval_time: 70m
                alertname: ChatTtftBurnRateTicket
                exp_alerts:
                  - exp_labels: {yaml.safe_dump(ticket["labels"], default_flow_style=True).strip()}
                    exp_annotations: {yaml.safe_dump(ticket["annotations"], default_flow_style=True, width=1000,
                                                     allow_unicode=True).strip()}
          - interval: 1m
            input_series:
              - series: 'vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m-8b",engine="0"}}'
                values: '0+995x180'
              - series: 'vllm:time_to_first_token_seconds_count{{model_name="m-8b",engine="0"}}'
                values: '0+1000x180'
            alert_rule_test:
              - eval_time: 70m
                alertname: ChatTtftBurnRatePage
                exp_alerts: []
              - eval_time: 70m
                alertname: ChatTtftBurnRateTicket
                exp_alerts: []
          - interval: 1m
            input_series:  # 1 slow request of 3 a minute: a 33× burn, but 3 bad requests an hour is the guard's minimum
              - series: 'vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m-8b",engine="0"}}'
                values: '0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 2'
              - series: 'vllm:time_to_first_token_seconds_count{{model_name="m-8b",engine="0"}}'
                values: '0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 3'
            alert_rule_test:
              - eval_time: 33m
                alertname: ChatTtftBurnRatePage
                exp_alerts: []
        """)
    path = tmp_path / "tests.yaml"
    path.write_text(tests)
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr + tests


def test_the_platform_ingest_alerts_come_with_the_rules_unless_asked_not_to(alpha):
    text, _ = export("--platform-selector", 'job="observatory"')
    groups = {g["name"]: g["rules"] for g in yaml.safe_load(text)["groups"]}
    alerts = {r["alert"]: r for r in groups["observatory-platform-ingest"]}
    assert set(alerts) == {"ObservatoryIngestLagHigh", "ObservatoryIngestStalled", "ObservatoryIngestShedding"}
    assert 'observatory_ingest_queryable_lag_seconds_bucket{job="observatory"}[5m]' in alerts["ObservatoryIngestLagHigh"]["expr"]
    assert alerts["ObservatoryIngestStalled"]["labels"] == {"severity": "page"}
    text, _ = export("--no-platform-rules")
    assert "observatory-platform-ingest" not in text


@needs_promtool
def test_promtool_unit_test_of_the_ingest_lag_and_stall_alerts(alpha, tmp_path):
    """Exports that become queryable in 40-60 s for 15 minutes: the lag alert fires (p99 above 30 s for 10m);
    the same within 1 s: quiet. A backlog whose oldest export waits ever longer: the stall page fires."""
    rules = tmp_path / "rules.yaml"
    export("--out", str(rules), "--project", "alpha")
    alerts = {r["alert"]: r for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"] if "alert" in r}

    def annotations(name: str, **rendered: str) -> str:
        """The alert's annotations with its templates as Prometheus renders them here."""
        values = dict(alerts[name]["annotations"])
        for template, text in rendered.items():
            values["description"] = values["description"].replace("{{ %s }}" % template.replace("__", " | "), text)
        values["description"] = values["description"].replace("{{ $labels.instance }}", "p:8000")
        return yaml.safe_dump(values, default_flow_style=True, width=10_000).strip()

    lag = annotations("ObservatoryIngestLagHigh", **{"$value__humanize": "59.7"})
    stalled = annotations("ObservatoryIngestStalled", **{"$value__humanizeDuration": "12m 0s"})
    shedding = annotations("ObservatoryIngestShedding")
    tests = textwrap.dedent(f"""\
        rule_files: [{rules}]
        evaluation_interval: 1m
        tests:
          - interval: 1m
            input_series:  # every export lands in the 30-60 s bucket
              - series: 'observatory_ingest_queryable_lag_seconds_bucket{{le="30",instance="p:8000"}}'
                values: '0+0x30'
              - series: 'observatory_ingest_queryable_lag_seconds_bucket{{le="60",instance="p:8000"}}'
                values: '0+50x30'
              - series: 'observatory_ingest_queryable_lag_seconds_bucket{{le="+Inf",instance="p:8000"}}'
                values: '0+50x30'
              - series: 'observatory_ingest_backlog_oldest_seconds{{instance="p:8000"}}'
                values: '0+60x30'
            alert_rule_test:
              - eval_time: 8m
                alertname: ObservatoryIngestLagHigh
                exp_alerts: []
              - eval_time: 20m
                alertname: ObservatoryIngestLagHigh
                exp_alerts:
                  - exp_labels: {{severity: ticket, instance: "p:8000"}}
                    exp_annotations: {lag}
              - eval_time: 6m
                alertname: ObservatoryIngestStalled
                exp_alerts: []
              - eval_time: 12m
                alertname: ObservatoryIngestStalled
                exp_alerts:
                  - exp_labels: {{severity: page, instance: "p:8000"}}
                    exp_annotations: {stalled}
          - interval: 1m
            input_series:  # healthy: everything queryable within a second, nothing waiting
              - series: 'observatory_ingest_queryable_lag_seconds_bucket{{le="1",instance="p:8000"}}'
                values: '0+50x30'
              - series: 'observatory_ingest_queryable_lag_seconds_bucket{{le="30",instance="p:8000"}}'
                values: '0+50x30'
              - series: 'observatory_ingest_queryable_lag_seconds_bucket{{le="+Inf",instance="p:8000"}}'
                values: '0+50x30'
              - series: 'observatory_ingest_backlog_oldest_seconds{{instance="p:8000"}}'
                values: '0+0x30'
              - series: 'observatory_ingest_backpressure_refusals_total{{reason="backlog_bytes",instance="p:8000"}}'
                values: '0+0x30'
            alert_rule_test:
              - eval_time: 25m
                alertname: ObservatoryIngestLagHigh
                exp_alerts: []
              - eval_time: 25m
                alertname: ObservatoryIngestStalled
                exp_alerts: []
              - eval_time: 25m
                alertname: ObservatoryIngestShedding
                exp_alerts: []
          - interval: 1m
            input_series:  # refusing exports for 20 minutes
              - series: 'observatory_ingest_backpressure_refusals_total{{reason="backlog_age",instance="p:8000"}}'
                values: '0+12x30'
            alert_rule_test:
              - eval_time: 12m
                alertname: ObservatoryIngestShedding
                exp_alerts: []
              - eval_time: 25m
                alertname: ObservatoryIngestShedding
                exp_alerts:
                  - exp_labels: {{severity: ticket, instance: "p:8000"}}
                    exp_annotations: {shedding}
        """)
    path = tmp_path / "tests.yaml"
    path.write_text(tests)
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr + tests
