"""The API contract walked by a fuzzer: schemathesis, driven by /api/v1/openapi.json, against a live platform
seeded with a project, requests, an SLO, an alert, a silence and a channel, in every phase (examples, coverage,
fuzzing, and the stateful phase that follows the document's links from each creation to its reads, changes
and deletion). It checks that no answer is a server error and that every status code, content type and body
is the one the document declares, and it must end without failures and without warnings (a "schema
validation mismatch" would mean the API refuses what the document allows; "missing test data", that it only
ever answered 404).

The figures (operations, cases, failures) are printed. CI runs it once, in server mode (PostgreSQL is the stricter
store: NUL characters, integer ranges); `make test` runs it in the mode it is given.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from observatory.bench.payloads import ChainTemplate
from otlp_live_helpers import post_traces

# The API document walked against one platform: one CI suite (tests/conftest.py), the server one.
pytestmark = pytest.mark.one_suite(suite="server")

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def call(platform, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(platform.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def seeded(module_platform_factory, tmp_path_factory):
    # Schemathesis sends requests without a token on purpose (the coverage phase): no lockout of its address.
    platform = module_platform_factory(extra_env={"API_AUTH_FAILURE_LIMIT": "100000000"},
                                       data_dir=str(tmp_path_factory.mktemp("fuzz") / "data"))
    token = platform.process.manage("create_api_token", "--user", "fuzz", "--role", "admin", "--project", "alpha")
    body, trace_ids = ChainTemplate(traces=5).batch()
    status, _, _ = post_traces(platform.process, platform.keys["alpha"], body)
    assert status == 200
    platform.process.wait_idle()
    status, slo = call(platform, "POST", "/api/v1/slos", token,
                       {"name": "fuzz-ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%"})
    assert status == 201, slo
    status, silence = call(platform, "POST", "/api/v1/silences", token,
                           {"matchers": ["slo=fuzz-ttft"], "duration": "30d", "comment": "seeded for the fuzzer"})
    assert status == 201, silence
    status, channel = call(platform, "POST", "/api/v1/channels", token,
                           {"name": "seeded", "kind": "webhook", "url": "https://hooks.example.com/observatory"})
    assert status == 201, channel
    fingerprint = platform.process.manage("shell", "-c", textwrap.dedent("""
        import hashlib
        from django.utils import timezone
        from alerts.models import Alert
        from slo.models import SLO
        slo = SLO.objects.get(name="fuzz-ttft")
        fingerprint = hashlib.sha256(b"fuzz").hexdigest()
        Alert.objects.create(project_id=slo.project_id, kind="slo_burn", severity="page", state="firing",
                             fingerprint=fingerprint, slo=slo, labels={"slo": slo.name, "severity": "page"},
                             started_at=timezone.now(), fired_at=timezone.now(), episode=1)
        print(fingerprint)
    """)).splitlines()[-1]
    status, dataset = call(platform, "POST", "/api/v1/datasets", token,
                           {"name": "fuzz-set", "items": [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Hi"}]})
    assert status == 201, dataset
    # A run (its target is not there: it ends in error, which the reads and the cancel still answer for).
    run_id = platform.process.manage("shell", "-c", textwrap.dedent("""
        from regressions import service
        from tenancy.models import Project
        run = service.create_run(Project.objects.get(name="alpha"), dataset="fuzz-set", target="http://127.0.0.1:9/v1",
                                 check=False, enqueue=False)
        print(run.id)
    """)).splitlines()[-1]
    # A tuning study of the default fleet file's group (queued; one trial, no confirmation, when a worker takes it).
    study_id = platform.process.manage("shell", "-c", textwrap.dedent("""
        from tuning import service
        from tenancy.models import Project
        study = service.create_study(Project.objects.get(name="alpha"), group="baseline", workload="synthetic:chat",
                                     trials=1, confirm=False, enqueue=False)
        print(study.id)
    """)).splitlines()[-1]
    # A rollout of the same group (no fleet runs: it pauses when its beat finds none), with one analysis to read.
    rollout_id, analysis_id = platform.process.manage("shell", "-c", textwrap.dedent("""
        from django.utils import timezone
        from rollouts import service
        from rollouts.models import RolloutAnalysis
        from tenancy.models import Project
        rollout = service.create_rollout(Project.objects.get(name="alpha"), group="baseline",
                                         config={"max_num_seqs": 64}, plan={"steps": ["approval"]})
        analysis = RolloutAnalysis.objects.create(rollout=rollout, step=0, since=timezone.now(), until=timezone.now(),
                                                  verdict="inconclusive", summary="seeded", figures={"metrics": []})
        print(rollout.id, analysis.id)
    """)).splitlines()[-1].split()
    yield {"platform": platform, "token": token, "trace_id": trace_ids[0], "slo": slo["name"],
           "silence": silence["silence"]["id"], "channel": channel["channel"]["id"], "fingerprint": fingerprint,
           "dataset": "fuzz-set", "run": int(run_id), "study": int(study_id), "rollout": int(rollout_id),
           "analysis": int(analysis_id)}


def config(seeded: dict, path: Path) -> Path:
    """schemathesis.toml: the seeded objects' ids for the operations that read one, warnings fail the run."""
    by_operation = {
        "traces_api_requests_view": {"query.trace_id": seeded["trace_id"]},
        "slo_api_read_slo": {"path.name": seeded["slo"]},
        "slo_api_replace_slo": {"path.name": seeded["slo"]},
        "slo_api_slo_history": {"path.name": seeded["slo"]},
        "alerts_api_alert_view": {"path.fingerprint": seeded["fingerprint"]},
        "alerts_api_read_silence": {"path.silence_id": seeded["silence"]},
        "alerts_api_expire_silence": {"path.silence_id": seeded["silence"]},
        "notify_api_read_channel": {"path.channel_id": seeded["channel"]},
        "notify_api_change_channel": {"path.channel_id": seeded["channel"]},
        "notify_api_test_channel": {"path.channel_id": seeded["channel"]},
        "notify_api_channel_deliveries": {"path.channel_id": seeded["channel"]},
        "regressions_api_read_dataset": {"path.name": seeded["dataset"]},
        "regressions_api_create_version": {"path.name": seeded["dataset"]},
        "regressions_api_read_run": {"path.run_id": seeded["run"]},
        "regressions_api_cancel_run": {"path.run_id": seeded["run"]},
        "regressions_api_read_comparison": {"path.run_id": seeded["run"]},
        "regressions_api_read_results": {"path.run_id": seeded["run"]},
        "tuning_api_read_study": {"path.study_id": seeded["study"]},
        "tuning_api_list_trials": {"path.study_id": seeded["study"]},
        "tuning_api_cancel_study": {"path.study_id": seeded["study"]},
        "tuning_api_propose": {"path.study_id": seeded["study"]},
        "rollouts_api_read_rollout": {"path.rollout_id": seeded["rollout"]},
        "rollouts_api_read_analysis": {"path.rollout_id": seeded["rollout"], "path.analysis_id": seeded["analysis"]},
    }
    # The project is a tenant's id like the others: a generated one is another tenant's (404, tested elsewhere).
    lines = ['parameters = { "query.project" = "alpha" }', "", "[warnings]", "fail-on = true", ""]
    for operation, parameters in by_operation.items():
        parameters = {"query.project": "alpha", **parameters}
        lines += ["[[operations]]", f'include-operation-id = "{operation}"',
                  "parameters = { " + ", ".join(f'"{k}" = {json.dumps(v)}' for k, v in parameters.items()) + " }", ""]
    # Deleting an SLO is walked in the stateful phase, on the SLOs its creations made (the seeded one is read
    # by the other operations; a generated name is 404, which is no test of the deletion).
    lines += ["[[operations]]", 'include-operation-id = "slo_api_delete_slo"', 'parameters = { "query.project" = "alpha" }',
              "phases.examples.enabled = false", "phases.coverage.enabled = false", "phases.fuzzing.enabled = false", ""]
    # Starting a regression run needs a target that answers (probed before the run is created): a generated
    # target never does, so every generated body is refused (400) and the fuzzer would call the document looser
    # than the API. Its input checks are tested in tests/regressions (bad targets, versions, gates, options).
    lines += ["[[operations]]", 'include-operation-id = "regressions_api_create_run"',
              'parameters = { "query.project" = "alpha" }', "phases.coverage.enabled = false",
              "phases.fuzzing.enabled = false", "phases.stateful.enabled = false", ""]
    # Starting a tuning study needs a replica group of the fleet: a generated name never is one, so every generated
    # body is refused (400). Its input checks are tested in tests/tuning (space, workload, group, SLO, tenancy).
    lines += ["[[operations]]", 'include-operation-id = "tuning_api_create_study"',
              'parameters = { "query.project" = "alpha" }', "phases.coverage.enabled = false",
              "phases.fuzzing.enabled = false", "phases.stateful.enabled = false", ""]
    # A rollout's controls change its state: the first abort ends it, and every later pause, abort or promote is a
    # 409 by design, which generated bodies cannot change. Examples and the stateful phase walk them; their input
    # checks and states are tested in tests/rollouts.
    for control in ("pause", "resume", "approve", "promote", "abort", "retry"):
        lines += ["[[operations]]", f'include-operation-id = "rollouts_api_{control}"',
                  "parameters = { " + f'"query.project" = "alpha", "path.rollout_id" = {seeded["rollout"]}' + " }",
                  "phases.coverage.enabled = false", "phases.fuzzing.enabled = false", ""]
    # Starting a rollout needs a replica group of the fleet too; its input checks are tested in tests/rollouts.
    lines += ["[[operations]]", 'include-operation-id = "rollouts_api_create_rollout"',
              'parameters = { "query.project" = "alpha" }', "phases.coverage.enabled = false",
              "phases.fuzzing.enabled = false", "phases.stateful.enabled = false", ""]
    path.write_text("\n".join(lines))
    return path


def test_schemathesis_finds_no_failure_and_no_warning_in_any_phase(seeded, tmp_path):
    platform = seeded["platform"]
    report = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config(seeded, tmp_path / "schemathesis.toml")),
        "run", platform.url + "/api/v1/openapi.json",
        "--header", f"Authorization: Bearer {seeded['token']}",
        "--checks", CHECKS, "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", "25", "--seed", "19", "--workers", "1", "--no-color",
        "--request-timeout", "30", "--report", "json", "--report-json-path", str(report),
        "--generation-database", "none",
    ]
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    took = time.monotonic() - started
    text = out.stdout + out.stderr
    summary = re.findall(r"(\d+) (passed|failed|errors?|skipped)", text)
    cases = re.search(r"Test cases:\s*\n?\s*([0-9,]+) generated", text)
    print(f"schemathesis: exit {out.returncode} in {took:.0f}s; {summary}; cases: {cases.group(1) if cases else '?'}")
    assert out.returncode == 0, text[-12000:]
    assert "Schema validation mismatch" not in text and "Missing test data" not in text, text[-8000:]
