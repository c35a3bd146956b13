"""Golden datasets (versioned, per project) and regression runs (a state machine in the database).

A dataset's items live in its versions: editing never changes a version, it writes a new one holding the whole
item set (items upserted by id). A run pins the version it replays. A run's per-request results are rows here
(outputs, scores, the figures of the platform's decomposed request row, joined by the trace id the run's client
span created); the request rows themselves stay in ClickHouse, and the run's client spans carry its id
(`llm_observatory.regression.run_id`).
"""
from __future__ import annotations

from django.db import models
from django.utils import timezone


class Dataset(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="dataset_name_per_project")]

    def __str__(self) -> str:
        return f"{self.project.name}/{self.name}"

    def latest(self) -> DatasetVersion | None:
        return self.versions.order_by("-number").first()


class DatasetVersion(models.Model):
    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.CharField(max_length=150, blank=True, default="")
    source = models.CharField(max_length=200, blank=True, default="")  # "import openai data.jsonl", "api", ...
    note = models.CharField(max_length=500, blank=True, default="")
    item_count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["dataset", "number"], name="dataset_version_number")]
        ordering = ["dataset", "number"]


class DatasetItem(models.Model):
    version = models.ForeignKey(DatasetVersion, on_delete=models.CASCADE, related_name="items")
    position = models.PositiveIntegerField()
    item_id = models.CharField(max_length=200)
    # Exactly one of messages (chat) and prompt (completions).
    messages = models.JSONField(null=True, blank=True)
    prompt = models.TextField(null=True, blank=True)
    params = models.JSONField(default=dict)  # max_tokens, temperature, top_p, stop, seed, ignore_eos ...
    expected = models.TextField(null=True, blank=True)
    evaluators = models.JSONField(default=list)
    tags = models.JSONField(default=list)
    metadata = models.JSONField(default=dict)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["version", "item_id"], name="dataset_item_id_per_version")]
        ordering = ["version", "position"]

    def as_dict(self) -> dict:
        data = {"id": self.item_id}
        if self.messages is not None:
            data["messages"] = self.messages
        else:
            data["prompt"] = self.prompt
        data["params"] = self.params or {}
        if self.expected is not None:
            data["expected"] = self.expected
        data["evaluators"] = self.evaluators or []
        data["tags"] = self.tags or []
        data["metadata"] = self.metadata or {}
        return data


class RunState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    ANALYSING = "analysing"
    DONE = "done"          # finished with a verdict
    ERROR = "error"        # could not finish (the reason is in `error`)
    CANCELLED = "cancelled"


ACTIVE_STATES = (RunState.QUEUED, RunState.RUNNING, RunState.ANALYSING)


class Verdict(models.TextChoices):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


class RegressionRun(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="regression_runs")
    dataset_version = models.ForeignKey(DatasetVersion, on_delete=models.PROTECT, related_name="runs")
    # {"kind": "url", "url": OpenAI base URL} | {"kind": "group", "group": replica group} |
    # {"kind": "config", "config": vLLM knobs, "version": cfg-…} (a simulated replica started for the run)
    target = models.JSONField()
    # Paired mode: the baseline replayed in the same run, interleaved item by item (same shape as target).
    baseline_target = models.JSONField(null=True, blank=True)
    # Else the run compared with (None: the last passing run of the same dataset and target, if any).
    baseline_run = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    options = models.JSONField(default=dict)
    gates = models.JSONField(default=dict)
    state = models.CharField(max_length=16, choices=RunState.choices, default=RunState.QUEUED)
    verdict = models.CharField(max_length=16, choices=Verdict.choices, blank=True, default="")
    error = models.TextField(blank=True, default="")
    progress_done = models.PositiveIntegerField(default=0)
    progress_total = models.PositiveIntegerField(default=0)
    cancel_requested = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.CharField(max_length=150, blank=True, default="")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    requests_ended_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    lease = models.CharField(max_length=32, blank=True, default="")  # the claim of the worker executing it
    attempts = models.PositiveIntegerField(default=0)  # executions started (a restart resumes: +1)
    synthetic = models.BooleanField(default=False)  # outputs came from the simulator
    summary = models.JSONField(default=dict)   # per arm: counts, error rate, pass rate, quantiles
    comparison = models.JSONField(default=dict)  # gates, per-metric tests, per-bucket tables

    class Meta:
        indexes = [models.Index(fields=["project", "-created_at"]), models.Index(fields=["state"])]

    @property
    def label(self) -> str:
        return target_label(self.target)


def target_label(target: dict | None) -> str:
    if not target:
        return ""
    if target.get("kind") == "group":
        return f"group:{target.get('group')}"
    if target.get("kind") == "config":
        return f"config:{target.get('version')}"
    return str(target.get("url", ""))


class Arm(models.TextChoices):
    CANDIDATE = "candidate"
    BASELINE = "baseline"


class RunResult(models.Model):
    run = models.ForeignKey(RegressionRun, on_delete=models.CASCADE, related_name="results")
    # candidate | baseline, or a cache sweep's pass at one threshold: "t0.85" (regressions.cache_sweep.arm_of)
    arm = models.CharField(max_length=10, choices=Arm.choices, default=Arm.CANDIDATE)
    item_id = models.CharField(max_length=200)
    repetition = models.PositiveIntegerField(default=0)
    warmup = models.BooleanField(default=False)
    trace_id = models.CharField(max_length=32, blank=True, default="")
    success = models.BooleanField(default=False)
    status = models.IntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    output = models.TextField(blank=True, default="")
    finish_reason = models.CharField(max_length=40, blank=True, default="")
    prompt_tokens = models.IntegerField(null=True, blank=True)
    completion_tokens = models.IntegerField(null=True, blank=True)
    # The client's measurements and the decomposed row's: ttft_ms, tpot_ms, itl_ms, e2e_ms, queue_ms, ...
    metrics = models.JSONField(default=dict)
    prompt_bucket = models.CharField(max_length=20, blank=True, default="")
    row_found = models.BooleanField(default=False)
    scores = models.JSONField(default=dict)  # evaluator → {"score", "passed", "detail"?}
    passed = models.BooleanField(null=True)  # every evaluator passed (None: no evaluator)
    sent_at = models.DateTimeField(null=True, blank=True)
    # What answered: engine, or the gateway's response cache (exact_cache | semantic_cache, its X-Observatory-Cache
    # header); "" for results recorded before it was kept.
    served_from = models.CharField(max_length=20, blank=True, default="")
    # The best similarity the gateway's semantic lookup found (its span's observatory.cache.similarity), when it
    # looked one up: a cache sweep's passes.
    similarity = models.FloatField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "arm", "item_id", "repetition", "warmup"],
                                               name="run_result_once")]
        ordering = ["run", "id"]
