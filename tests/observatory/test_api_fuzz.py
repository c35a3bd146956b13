"""The API contract walked by a fuzzer: schemathesis, driven by /api/v1/openapi.json, against a live platform
seeded with a project, requests, an SLO, an alert, a silence, a channel, datasets, a run, a study and a rollout, in
every phase (examples, coverage, fuzzing, and the stateful phase that follows the document's links from each
creation to its reads, changes and deletion). It checks that no answer is a server error and that every status
code, content type and body is the one the document declares, and it must end without failures and without
warnings (a "schema validation mismatch" would mean the API refuses what the document allows; "missing test data",
that it only ever answered 404).

Creations and the operations that use up what they act on are walked in every phase too: hooks in the fuzzer's
process (api_fuzz_hooks.py) write into each creation the names of what exists (a dataset, a replica group), give
each deletion, cancellation and rollout control an object of its own in a state it acts on, and undo every
creation as it is answered (a run or a study cancelled, a rollout aborted). The platform runs no worker, so
nothing a creation queues ever starts (a replay, a study's trials, a rollout's ticks). The hooks log every case:
the test fails below a floor of operations and cases per phase, and prints the figures.

CI runs it once, in server mode (PostgreSQL is the stricter store: NUL characters, integer ranges); the figures
and so the floor are the same in embedded mode, which `make test` runs when it is given no database.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from benchkit.harness import free_port
from benchkit.payloads import ChainTemplate
from otlp_live_helpers import post_traces

# The API document walked against one platform: one CI suite (tests/conftest.py), the server one (a second, in
# embedded mode, would add its ~3 minutes to a CI run near its limit for the same figures).
pytestmark = pytest.mark.one_suite(suite="server")

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
PHASES = ("examples", "coverage", "fuzzing", "stateful")
HOOKS = Path(__file__).with_name("api_fuzz_hooks.py")
# What the creations name (the hooks write them into the bodies the fuzzer generates).
NAMES = {"dataset": "fuzz-replay", "study_group": "baseline", "rollout_group": "fuzz-new",
         "control_group": "fuzz-control", "doomed_slo": "fuzz-doomed"}
# The floor. The examples, coverage and fuzzing phases walk every operation of the document (48, at least
# MIN_OPERATIONS); the stateful phase, what the links (declared and inferred) lead to from where its scenarios
# start: at least MIN_STATEFUL_OPERATIONS. At least MIN_CASES cases per phase. Measured in both modes, the same
# (seed 19): examples 48 operations and 154 cases, coverage 48 and 5,729, fuzzing 48 and 635, stateful 33 and 135.
# With the 65 operations of 2026-11-29 (the loops' among them), server mode: examples 338 cases, coverage 6,970,
# fuzzing 915, stateful 29 operations and 65 cases: the stateful phase's scenarios now also start from the loops'
# controls, whose chains end at once (a loop decided or ended answers 409), so they walk fewer steps in all.
MIN_OPERATIONS = 48
# Loops seeded awaiting approval for the controls and link decisions that use one up (about 130 cases each).
SEEDED_LOOPS = 1500
MIN_STATEFUL_OPERATIONS = 28
MIN_CASES = {"examples": 140, "coverage": 5200, "fuzzing": 570, "stateful": 55}


def call(platform, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(platform.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def fleet_file(directory: Path) -> Path:
    """The fleet the platform takes its replica groups from. No controller runs (no control token in its run
    directory: nothing is ever asked of one), so creations check their group against this file: the seeded study
    and rollout change baseline, the fuzzer's rollouts fuzz-new, and the controls act on rollouts of fuzz-control."""
    groups = "".join(f"  - {{name: {name}, weight: {weight}, replicas: 1, backend: simulator, "
                     f"config: {{model: meta-llama/Llama-3.1-8B-Instruct}}}}\n"
                     for name, weight in (("baseline", 80), (NAMES["rollout_group"], 10), (NAMES["control_group"], 10)))
    path = directory / "fleet.yaml"
    path.write_text(f"name: fuzz\nrun_dir: {directory / 'engine'}\ncontrol: {{bind: \"127.0.0.1:{free_port()}\"}}\n"
                    f"gateway: {{bind: \"127.0.0.1:{free_port()}\"}}\ngroups:\n{groups}")
    return path


@pytest.fixture(scope="module")
def seeded(module_platform_factory, tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    # Schemathesis sends requests without a token on purpose (the coverage phase): no lockout of its address.
    # No worker: what a creation queues (a replay, a study's trials, a rollout's ticks) never starts, so the API
    # alone changes what the fuzzer reads, and each creation is undone (cancelled, aborted) as it is answered.
    # A calibration needs no traffic here (the fuzzer's creations must be answered, and no worker fits them).
    platform = module_platform_factory(extra_env={"API_AUTH_FAILURE_LIMIT": "100000000",
                                                  "OBSERVATORY_INPROCESS_WORKER": "0",
                                                  "TUNING_CALIBRATION_MIN_REQUESTS": "0",
                                                  # An evaluation of the seeded model is answered on no traffic.
                                                  "TUNING_MODEL_LIVE_MIN_REQUESTS": "0",
                                                  "ENGINE_FLEET": str(fleet_file(directory))},
                                       data_dir=str(directory / "data"))
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
    # Two datasets: one whose versions the fuzzer makes (items upserted, deleted, replaced), one that runs replay.
    for name in ("fuzz-set", NAMES["dataset"]):
        status, dataset = call(platform, "POST", "/api/v1/datasets", token,
                               {"name": name, "items": [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Hi"}]})
        assert status == 201, dataset
    # What the API cannot make: a firing alert; a run whose target is not there (queued: the reads and the cancel
    # answer for it); a study of baseline (queued: one trial, no confirmation); a rollout of baseline waiting at
    # its approval step (which only a worker's tick reaches), with one analysis to read. One shell: each costs a
    # Django start.
    ids = platform.process.manage("shell", "-c", textwrap.dedent("""
        import hashlib, json
        from django.utils import timezone
        from alerts.models import Alert
        from regressions import service as regressions
        from rollouts import service as rollouts
        from rollouts.models import RolloutAnalysis
        from rollouts.transitions import transition
        from slo.models import SLO
        from tenancy.models import Project
        from tuning import service as tuning
        from tuning.models import EngineModel
        alpha = Project.objects.get(name="alpha")
        slo = SLO.objects.get(name="fuzz-ttft")
        fingerprint = hashlib.sha256(b"fuzz").hexdigest()
        Alert.objects.create(project_id=slo.project_id, kind="slo_burn", severity="page", state="firing",
                             fingerprint=fingerprint, slo=slo, labels={"slo": slo.name, "severity": "page"},
                             started_at=timezone.now(), fired_at=timezone.now(), episode=1)
        run = regressions.create_run(alpha, dataset="fuzz-replay", target="http://127.0.0.1:9/v1", check=False,
                                     enqueue=False)
        study = tuning.create_study(alpha, group="baseline", workload="synthetic:chat", trials=1, confirm=False,
                                    enqueue=False)
        model = EngineModel.objects.create(project=alpha, group="baseline", config_version="cfg-seeded",
                                           window_start=timezone.now(), window_end=timezone.now(), state="fitted",
                                           base_profile="H100", constants={"mfu": 0.5},
                                           held_out_error={"ttft_ms_p50": 0.02, "tpot_ms_p50": -0.01})
        rollout = rollouts.create_rollout(alpha, group="baseline", config={"max_num_seqs": 64},
                                          plan={"steps": ["approval"]})
        rollout = transition(rollout, to_state="progressing", action="started", step=0,
                             reason="seeded at its approval step", step_started_at=timezone.now())
        analysis = RolloutAnalysis.objects.create(rollout=rollout, step=0, since=timezone.now(), until=timezone.now(),
                                                  verdict="inconclusive", summary="seeded", figures={"metrics": []})
        # Loops: a page starts them, no API call makes one. Each loop control and each approval link's decision uses
        # up the loop it acts on: the hooks hand every such case a seeded loop of its own, awaiting approval (no
        # worker ticks them); one more is only read.
        from datetime import timedelta
        from loops import service as loop_service
        from loops.models import Loop
        expires = timezone.now() + timedelta(days=1)
        seeded_loops = Loop.objects.bulk_create([
            Loop(project=alpha, group=f"fuzz-loop-{i}", mode="approve", state="awaiting_approval",
                 policy={"approval_seconds": 86400}, approval_nonce=loop_service.new_nonce(),
                 approval_expires_at=expires, trigger={"component": "queue"}) for i in range(LOOPS + 1)])
        seeded_loops = list(Loop.objects.filter(project=alpha, group__startswith="fuzz-loop-").order_by("id"))
        with open(LOOPS_FILE, "w") as out:
            json.dump([{"id": x.id, "token": loop_service.approval_token(x)} for x in seeded_loops], out)
        print(json.dumps({"fingerprint": fingerprint, "run": run.id, "study": study.id, "rollout": rollout.id,
                          "analysis": analysis.id, "model": model.id}))
    """).replace("LOOPS_FILE", repr(str(directory / "loops.json"))).replace("LOOPS + 1", str(SEEDED_LOOPS + 1))
    ).splitlines()[-1]
    loops = json.loads((directory / "loops.json").read_text())
    (directory / "loops-pool.json").write_text(json.dumps(loops[1:]))  # loops[0] is only read
    yield {"platform": platform, "token": token, "trace_id": trace_ids[0], "slo": slo["name"],
           "silence": silence["silence"]["id"], "channel": channel["channel"]["id"], "dataset": "fuzz-set",
           "loop": loops[0], "loops_file": str(directory / "loops-pool.json"), **json.loads(ids)}


def config(seeded: dict, path: Path) -> Path:
    """schemathesis.toml: the seeded objects' ids for the operations that read one, an example generated for the
    operations the document gives none (the examples phase walks every operation), warnings fail the run."""
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
        # Outside the stateful phase the hooks give the cancellations and the rollout controls (but approve: the
        # seeded rollout waits at its approval step) an object in a state each acts on.
        "regressions_api_cancel_run": {"path.run_id": seeded["run"]},
        "regressions_api_read_comparison": {"path.run_id": seeded["run"]},
        "regressions_api_read_results": {"path.run_id": seeded["run"]},
        "tuning_api_read_study": {"path.study_id": seeded["study"]},
        "tuning_api_list_trials": {"path.study_id": seeded["study"]},
        "tuning_api_cancel_study": {"path.study_id": seeded["study"]},
        "tuning_api_propose": {"path.study_id": seeded["study"]},
        "tuning_api_read_model": {"path.model_id": seeded["model"]},
        "tuning_api_evaluate_model": {"path.model_id": seeded["model"]},
        "rollouts_api_read_rollout": {"path.rollout_id": seeded["rollout"]},
        "rollouts_api_read_analysis": {"path.rollout_id": seeded["rollout"], "path.analysis_id": seeded["analysis"]},
        **{f"rollouts_api_{control}": {"path.rollout_id": seeded["rollout"]}
           for control in ("pause", "resume", "approve", "promote", "abort", "retry")},
        # The hooks give the loop controls and the link's decision a seeded loop of their own (outside the stateful
        # phase); the reads take the one loop nothing decides.
        **{f"loops_api_{operation}": {"path.loop_id": seeded["loop"]["id"]}
           for operation in ("read_loop", "pause", "resume", "end", "approve", "deny")},
        **{f"loops_api_{operation}": {"path.token": seeded["loop"]["token"]}
           for operation in ("read_approval", "decide_approval")},
    }
    # The project is a tenant's id like the others: a generated one is another tenant's (404, tested elsewhere).
    lines = ['parameters = { "query.project" = "alpha" }', "phases.examples.fill-missing = true", "",
             "[warnings]", "fail-on = true", ""]
    for operation, parameters in by_operation.items():
        parameters = {"query.project": "alpha", **parameters}
        lines += ["[[operations]]", f'include-operation-id = "{operation}"',
                  "parameters = { " + ", ".join(f'"{k}" = {json.dumps(v)}' for k, v in parameters.items()) + " }", ""]
    path.write_text("\n".join(lines))
    return path


def walked(ledger: Path) -> tuple[dict[str, dict[str, int]], list[str]]:
    """From the hooks' ledger: cases per operation per phase, and what the hooks could not set up or undo."""
    cases: dict[str, dict[str, int]] = {phase: {} for phase in PHASES}
    problems = []
    for line in ledger.read_text().splitlines():
        entry = json.loads(line)
        if "problem" in entry:
            problems.append(entry["problem"])
        else:
            per_operation = cases.setdefault(entry["phase"], {})
            per_operation[entry["operation"]] = per_operation.get(entry["operation"], 0) + 1
    return cases, problems


def test_schemathesis_finds_no_failure_and_no_warning_in_any_phase(seeded, tmp_path):
    platform = seeded["platform"]
    ledger = tmp_path / "ledger.jsonl"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config(seeded, tmp_path / "schemathesis.toml")),
        "run", platform.url + "/api/v1/openapi.json",
        "--header", f"Authorization: Bearer {seeded['token']}",
        "--checks", CHECKS, "--phases", ",".join(PHASES),
        "--max-examples", "25", "--seed", "19", "--workers", "1", "--no-color",
        "--request-timeout", "30", "--generation-database", "none",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "FUZZ_API": platform.url, "FUZZ_TOKEN": seeded["token"],
           "FUZZ_LEDGER": str(ledger), "FUZZ_NAMES": json.dumps({**NAMES, "loops_file": seeded["loops_file"]})}
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    took = time.monotonic() - started
    text = out.stdout + out.stderr
    cases, problems = walked(ledger)
    print(f"schemathesis: exit {out.returncode} in {took:.0f}s; operations and cases per phase: "
          + "; ".join(f"{phase} {len(cases[phase])}, {sum(cases[phase].values())}" for phase in PHASES))
    assert out.returncode == 0, text[-12000:]
    assert "Schema validation mismatch" not in text and "Missing test data" not in text, text[-8000:]
    assert not problems, problems
    _, document = call(platform, "GET", "/api/v1/openapi.json", seeded["token"])
    operations = {o["operationId"] for methods in document["paths"].values() for o in methods.values()}
    assert len(operations) >= MIN_OPERATIONS, sorted(operations)
    for phase in ("examples", "coverage", "fuzzing"):
        assert set(cases[phase]) == operations, (phase, "not walked:", sorted(operations - set(cases[phase])))
    assert len(cases["stateful"]) >= MIN_STATEFUL_OPERATIONS, ("stateful", sorted(cases["stateful"]))
    for phase in PHASES:
        assert sum(cases[phase].values()) >= MIN_CASES[phase], (phase, cases[phase])
