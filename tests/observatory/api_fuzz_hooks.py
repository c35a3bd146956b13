"""Schemathesis hooks of the API fuzzer (test_api_fuzz.py loads them into the fuzzer's process through
SCHEMATHESIS_HOOKS): they log every case walked, point creations and rollout controls at objects that exist
and are in a state the operation can act on, and undo what each creation started.

Set by the test: FUZZ_API (the platform's URL), FUZZ_TOKEN (an admin's token), FUZZ_LEDGER (the JSON-lines file
of cases and clean-ups written here) and FUZZ_NAMES (a JSON object: dataset, study_group, rollout_group,
control_group, doomed_slo).
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import schemathesis

API = os.environ.get("FUZZ_API", "")
TOKEN = os.environ.get("FUZZ_TOKEN", "")
NAMES = json.loads(os.environ.get("FUZZ_NAMES") or "{}")
LEDGER = open(os.environ["FUZZ_LEDGER"], "a", buffering=1) if os.environ.get("FUZZ_LEDGER") else None  # noqa: SIM115

# The config every rollout made here takes: a knob the fleet file's groups leave at vLLM's default.
ROLLOUT_CONFIG = {"max_num_seqs": 64}
# The seeded datasets' items, and the most a version of the fuzzer's keeps.
SEED_ITEMS = [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Hi"}]
SMALL_VERSION = 10
FINAL = {"promoted", "rolled_back", "aborted", "failed"}
RUNNING = {"pending", "gating", "progressing"}


def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One call to the platform's API as the fuzzer's admin, in project alpha."""
    url = f"{API}/api/v1{path}{'&' if '?' in path else '?'}project=alpha"
    request = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def record(**entry) -> None:
    if LEDGER is not None:
        LEDGER.write(json.dumps(entry) + "\n")


def expect(status: int, answer: dict, wanted: int, what: str) -> bool:
    """A set-up or clean-up call's answer; one that is not `wanted` goes to the ledger (the test fails on it)."""
    if status != wanted:
        record(problem=f"{what}: {status} {answer}")
        return False
    return True


def operation_id(case) -> str:
    return case.operation.definition.raw.get("operationId", case.operation.label)


def phase_of(case) -> str:
    return case.meta.phase.name.value if case.meta is not None else "unknown"


def is_positive(case) -> bool:
    return case.meta is not None and case.meta.generation.mode.value == "positive"


# -- creations: the names they refer to, and a complete form until one was made ---------------------------
# A creation names things that must exist (a dataset, a replica group of the fleet), which a generated name never
# is: those fields name what the test seeded. Its other fields stay generated; most of them pass only the domain's
# checks too (an engine config, a search space, gates), so a positive case of an operation that has not made
# anything yet in the phase also leaves out (or sets) those, making the creation's answer walked, not only refusals.
def _run_body(body: dict, complete: bool) -> None:
    body["dataset"] = NAMES["dataset"]
    if complete:
        for field in ("version", "target", "baseline", "baseline_config", "gates"):
            body.pop(field, None)
        body["target_config"] = {}
        if isinstance(body.get("options"), dict):  # a cache sweep needs a gateway target, not a config started
            body["options"].pop("cache_sweep", None)


def _study_body(body: dict, complete: bool) -> None:
    body["group"] = NAMES["study_group"]
    if complete:
        body.pop("space", None)
        body.pop("slo", None)
        body["workload"] = "synthetic:chat"


def _model_body(body: dict, complete: bool) -> None:
    body["group"] = NAMES["study_group"]


def _rollout_body(body: dict, complete: bool) -> None:
    body["group"] = NAMES["rollout_group"]
    if complete:
        body.pop("from_study", None)
        body.pop("plan", None)
        body["config"] = dict(ROLLOUT_CONFIG)


CREATIONS = {
    "regressions_api_create_run": (_run_body, "/regression-runs/{}/cancel"),
    "tuning_api_create_study": (_study_body, "/tuning-studies/{}/cancel"),
    "tuning_api_create_model": (_model_body, "/engine-models/{}/cancel"),
    "rollouts_api_create_rollout": (_rollout_body, "/rollouts/{}/abort"),
}
made: set[tuple[str, str]] = set()  # (phase, operation) that answered a creation


# -- operations that use up what they act on: each case gets an object of its own kind, made again once used -------
def _made(what: str, status: int, answer: dict, key: str = "id", expected: int = 201):
    return answer[key] if expect(status, answer, expected, f"making {what}") else None


def _slo() -> str | None:
    # The seeded SLO is read by the other operations: deletions take one of their own.
    status, answer = call("POST", "/slos", {"name": NAMES["doomed_slo"], "sli": "ttft_ms", "threshold_ms": 500,
                                            "objective": "99%"})
    return NAMES["doomed_slo"] if status == 409 else _made("an SLO to delete", status, answer, "name")


def _run() -> int | None:
    return _made("a run to cancel", *call("POST", "/regression-runs", {"dataset": NAMES["dataset"],
                                                                       "target_config": {}}))


def _study() -> int | None:
    return _made("a study to cancel", *call("POST", "/tuning-studies", {
        "group": NAMES["study_group"], "workload": "synthetic:chat", "trials": 1, "confirm": False}))


def _model() -> int | None:
    return _made("a calibration to cancel", *call("POST", "/engine-models", {"group": NAMES["study_group"]}),
                 expected=202)


class Subject:
    """What one operation acts on outside the stateful phase (which follows the document's links): made when
    needed, forgotten when the operation answered 2xx (deleted, cancelled)."""

    def __init__(self, parameter: str, make) -> None:
        self.parameter, self.make, self.value = parameter, make, None

    def ready(self, action: str):
        """The object, made if there is none (`action`: the operation's verb, e.g. cancel)."""
        if self.value is None:
            self.value = self.make()
        return self.value

    def answered(self, answer: dict) -> None:
        self.value = None


class ControlRollout(Subject):
    """The rollout of the control group that pause, resume, promote, abort and retry act on: no worker runs in
    the fuzzer's platform, so it changes only through the API, and its state is known here. Approving needs a
    rollout at its approval step, which only a worker's tick reaches: approve acts on the seeded rollout, waiting
    there (the approval leaves it there, with no worker to move it on)."""

    def __init__(self) -> None:
        super().__init__("rollout_id", None)
        self.state = ""

    def fresh(self) -> None:
        if self.value is not None and self.state not in FINAL:
            expect(*call("POST", f"/rollouts/{self.value}/abort", {"reason": "fuzzer: the next control"}), 202,
                   f"aborting control rollout {self.value}")
        self.value = self.state = None
        status, answer = call("POST", "/rollouts", {"group": NAMES["control_group"], "config": ROLLOUT_CONFIG,
                                                    "plan": {"steps": ["approval"]}})
        if _made("a control rollout", status, answer):
            self.value, self.state = answer["id"], answer["state"]

    def move(self, control: str) -> None:
        status, answer = call("POST", f"/rollouts/{self.value}/{control}", {} if control == "pause" else None)
        if expect(status, answer, 202, f"{control} of control rollout {self.value}"):
            self.state = answer["state"]

    def ready(self, action: str):
        """The rollout, in a state where `action` is allowed (pause: running; resume and retry: paused; promote
        and abort: not finished)."""
        if self.value is None or self.state in FINAL or (action == "pause" and self.state not in RUNNING):
            self.fresh()
        if self.value is not None and action in ("resume", "retry") and self.state != "paused":
            self.move("pause")
        return self.value

    def answered(self, answer: dict) -> None:
        self.state = answer["state"]


control_rollout = ControlRollout()
# Loops the test seeded awaiting approval ({"id", "token"}): no API call makes a loop (a page does).
LOOPS: list[dict] = json.loads(open(NAMES["loops_file"]).read()) if NAMES.get("loops_file") else []


class SeededLoop(Subject):
    """A loop control or an approval link's decision: a seeded loop of its own, awaiting approval (resume: paused
    first), a fresh one once a 2xx answer used it."""

    def __init__(self, parameter: str, key: str) -> None:
        super().__init__(parameter, None)
        self.key = key

    def ready(self, action: str):
        if self.value is None and LOOPS:
            loop = LOOPS.pop()
            if action == "resume":
                expect(*call("POST", f"/loops/{loop['id']}/pause"), 202, f"pausing loop {loop['id']}")
            self.value = loop[self.key]
        return self.value


SUBJECTS = {
    "slo_api_delete_slo": Subject("name", _slo),
    "regressions_api_cancel_run": Subject("run_id", _run),
    "tuning_api_cancel_study": Subject("study_id", _study),
    "tuning_api_cancel_model": Subject("model_id", _model),
    **{f"rollouts_api_{control}": control_rollout for control in ("pause", "resume", "promote", "abort", "retry")},
    **{f"loops_api_{control}": SeededLoop("loop_id", "id") for control in ("pause", "resume", "end", "approve", "deny")},
    "loops_api_decide_approval": SeededLoop("token", "token"),
}


def declared_method(case) -> bool:
    """False for the coverage phase's requests with a method the operation does not declare (they reach none of
    its views)."""
    return case.method.upper() == case.operation.method.upper()


@schemathesis.hook
def before_call(context, case, kwargs):
    operation, phase = operation_id(case), phase_of(case)
    if not declared_method(case):
        return
    if operation in CREATIONS and isinstance(case.body, dict):
        shape, _ = CREATIONS[operation]
        shape(case.body, complete=is_positive(case) and (phase, operation) not in made)
    elif operation in SUBJECTS and phase != "stateful":
        subject = SUBJECTS[operation]
        value = subject.ready(operation.rsplit("_", 1)[-1])
        if value is not None:
            case.path_parameters = {**(case.path_parameters or {}), subject.parameter: value}


@schemathesis.hook
def after_call(context, case, response):
    operation, phase, status = operation_id(case), phase_of(case), response.status_code
    record(phase=phase, operation=operation, status=status)
    if not 200 <= status < 300 or not declared_method(case):
        return
    answer = json.loads(response.content or b"{}")
    if operation in CREATIONS:
        made.add((phase, operation))
        _, undo = CREATIONS[operation]
        expect(*call("POST", undo.format(answer["id"]), {} if undo.endswith("abort") else None), 202,
               f"undoing {operation} {answer['id']}")
    elif operation in SUBJECTS and phase != "stateful":
        SUBJECTS[operation].answered(answer)
    elif operation == "regressions_api_create_version" and answer["item_count"] > SMALL_VERSION:
        # Each version copies the last one's items: after a big one (from traffic: 100 synthetic prompts of the
        # traffic's lengths), the hundreds that follow would each copy them (~4x the fuzzer's time on versions).
        name = case.path_parameters["name"]
        expect(*call("POST", f"/datasets/{name}/versions", {"items": SEED_ITEMS, "replace": True,
                                                             "note": "fuzzer: small again"}), 201,
               f"making dataset {name} small again")
