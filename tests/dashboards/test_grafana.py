"""The Grafana dashboards in dashboards/grafana/: generated (the committed JSON is what generate.py writes), valid
PromQL (every expression through `promtool check rules`, skipped with the reason when promtool is missing; CI fetches
it), metric names the platform and vLLM 0.32 export, and vLLM's per-request means as rate(_sum) / rate(_count)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards.grafana import generate

REPO = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
# vLLM 0.32's metric families (../shared/VLLM_CPU.md, "Metrics seen on /metrics"), without their suffixes.
VLLM_FAMILIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
}
SUFFIX = re.compile(r"_(total|bucket|sum|count)$")


def _expressions(board: dict) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def _concrete(expr: str) -> str:
    return expr.replace("$project", ".*").replace("$model", ".*").replace("$engine", ".*")


@pytest.mark.parametrize("name", sorted(generate.BOARDS))
def test_the_committed_json_is_what_the_generator_writes(name):
    assert (REPO / "dashboards" / "grafana" / name).read_text() == generate.render(name), \
        "run: python -m dashboards.grafana.generate"


@pytest.mark.parametrize("name", sorted(generate.BOARDS))
def test_dashboard_structure(name):
    board = json.loads((REPO / "dashboards" / "grafana" / name).read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["templating"]["list"][0] == {"name": "datasource", "type": "datasource", "query": "prometheus",
                                              "label": "Prometheus", "current": {}}
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24


def test_platform_metric_names_exist_in_the_platform():
    source = "\n".join(p.read_text() for p in (REPO / "platform").rglob("*.py"))
    board = json.loads((REPO / "dashboards" / "grafana" / "observatory-platform.json").read_text())
    names = {SUFFIX.sub("", m) for e in _expressions(board) for m in re.findall(r"observatory_[a-z_]+", e)}
    assert names and all(f'"{name}"' in source for name in names), sorted(n for n in names if f'"{n}"' not in source)


def test_vllm_names_and_means():
    board = json.loads((REPO / "dashboards" / "grafana" / "vllm.json").read_text())
    expressions = _expressions(board)
    used = {SUFFIX.sub("", m) for e in expressions for m in re.findall(r"vllm:[a-z0-9_]+", e)}
    assert used <= VLLM_FAMILIES, used - VLLM_FAMILIES
    assert "vllm:time_per_output_token_seconds" not in json.dumps(board)  # the name vLLM removed
    for expr in expressions:
        for metric in re.findall(r"(vllm:[a-z0-9_]+)_sum", expr):
            # A mean: the rate of the sum divided by the rate of the count of the same histogram, never alone.
            assert re.search(rf"rate\({re.escape(metric)}_sum[^)]*\)\)\s*/\s*sum by \([a-z_]+\) "
                             rf"\(rate\({re.escape(metric)}_count", expr), expr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus; CI fetches it)")
@pytest.mark.parametrize("name", sorted(generate.BOARDS))
def test_every_expression_is_valid_promql(name, tmp_path):
    board = json.loads((REPO / "dashboards" / "grafana" / name).read_text())
    rules = {"groups": [{"name": "grafana", "rules": [
        {"record": f"grafana:check:{i}", "expr": _concrete(expr)} for i, expr in enumerate(_expressions(board))]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules['groups'][0]['rules'])} rules found" in done.stdout
