"""Tuning studies: what is tuned (group, workload, objective, space), how far it got, and what it found.

The trials themselves live in Optuna's tables (RDB storage in the same database), named
``tuning-<study id>``; the study row holds the lease of the worker executing it, the
progress, and the result (best config, robust re-scoring, explanation, confirmation).
"""
from django.db import models
from django.utils import timezone


class StudyState(models.TextChoices):
    QUEUED = "queued"
    SEARCHING = "searching"
    RESCORING = "rescoring"
    CONFIRMING = "confirming"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_STATES = (StudyState.QUEUED, StudyState.SEARCHING, StudyState.RESCORING, StudyState.CONFIRMING)


class Objective(models.TextChoices):
    GOODPUT = "goodput", "SLO goodput (requests/s)"
    GOODPUT_PER_GPU = "goodput_per_gpu", "SLO goodput per GPU"
    PARETO = "pareto", "goodput against p99 TTFT (Pareto front)"


class TuningStudy(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="tuning_studies")
    group = models.CharField(max_length=100)
    objective = models.CharField(max_length=20, choices=Objective.choices, default=Objective.GOODPUT)
    current_config = models.JSONField()
    workload = models.JSONField()  # tuning.workload.Workload.to_dict(), samples included
    slo = models.JSONField()  # thresholds, target share, where they came from
    space = models.JSONField()
    trials = models.PositiveIntegerField(default=60)  # valid trials to run
    seed = models.PositiveIntegerField(default=0)
    confirm = models.BooleanField(default=True)  # replay winner vs current on real-time replicas
    state = models.CharField(max_length=16, choices=StudyState.choices, default=StudyState.QUEUED)
    phase = models.CharField(max_length=200, blank=True, default="")
    trials_done = models.PositiveIntegerField(default=0)
    # Valid trials reserved by workers (running or done): a worker takes a slot before it asks Optuna for a point,
    # so workers sharing a study never run more than `trials` valid trials between them.
    slots_taken = models.PositiveIntegerField(default=0)
    invalid_trials = models.PositiveIntegerField(default=0)
    retried_trials = models.PositiveIntegerField(default=0)
    best_score = models.FloatField(null=True, blank=True)
    result = models.JSONField(default=dict)
    error = models.TextField(blank=True, default="")
    confirmation_run = models.ForeignKey("regressions.RegressionRun", null=True, blank=True,
                                         on_delete=models.SET_NULL, related_name="+")
    proposal = models.JSONField(null=True, blank=True)  # the winner proposed as a rollout
    # The group's calibrated engine model the trials simulate with (None: the published constants), and whether it
    # was used although its held-out error is above the bound (asked for with allow_unreliable).
    engine_model = models.ForeignKey("tuning.EngineModel", null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    unreliable_model = models.BooleanField(default=False)
    cancel_requested = models.BooleanField(default=False)
    lease = models.CharField(max_length=32, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["project", "-created_at"]), models.Index(fields=["state"])]

    @property
    def optuna_name(self) -> str:
        return f"tuning-{self.id}"

    def __str__(self) -> str:
        return f"tuning study {self.id} ({self.group})"


class TrialLease(models.Model):
    """A valid trial a worker is simulating: the worker beats its heartbeat; a stale lease means the worker died,
    and whoever finds it fails the Optuna trial, enqueues its point again and frees the slot."""

    study = models.ForeignKey(TuningStudy, on_delete=models.CASCADE, related_name="trial_leases")
    trial_id = models.BigIntegerField()  # Optuna's storage id of the trial
    number = models.PositiveIntegerField()
    worker = models.CharField(max_length=32)
    heartbeat_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["study", "trial_id"], name="tuning_trial_lease_unique")]


class ModelState(models.TextChoices):
    QUEUED = "queued"
    FITTING = "fitting"
    FITTED = "fitted"
    FAILED = "failed"
    CANCELLED = "cancelled"


MODEL_ACTIVE_STATES = (ModelState.QUEUED, ModelState.FITTING)


class EngineModel(models.Model):
    """One calibration of a replica group's engine model: the simulator's constants fitted to the traffic the group
    served in a window (engine/sim/traffic_fit.py), with the fit's error on the window's first four fifths and on
    its last fifth, held out. A model belongs to the config version the group ran in the window: a new version
    starts a new lineage. Executed by the worker like a study (queue ``tuning``, task ``tuning.calibrate``)."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="engine_models")
    group = models.CharField(max_length=100)
    config_version = models.CharField(max_length=64, blank=True, default="")  # the lineage
    config = models.JSONField(default=dict)  # the group's engine config (vLLM knob names)
    window_start = models.DateTimeField()
    window_end = models.DateTimeField()
    state = models.CharField(max_length=16, choices=ModelState.choices, default=ModelState.QUEUED)
    reason = models.TextField(blank=True, default="")  # why it failed
    base_profile = models.CharField(max_length=32, blank=True, default="")
    constants = models.JSONField(default=dict)  # fitted constant → value
    start_constants = models.JSONField(default=dict)  # the published values it started from
    fit_error = models.JSONField(default=dict)  # {"ttft_ms_p50": relative error, ...} on the fitting slice
    held_out_error = models.JSONField(default=dict)  # the same on the held-out slice (the window's last fifth)
    # {"ttft_ms": {"q": [5, ...], "observed": [...], "predicted": [...]}, ...} on the held-out slice
    held_out_curves = models.JSONField(default=dict)
    fit_requests = models.PositiveIntegerField(default=0)
    held_out_requests = models.PositiveIntegerField(default=0)
    queue_floor_ms = models.FloatField(default=1.0)
    fit_seconds = models.FloatField(null=True, blank=True)
    # The model's error on the group's latest traffic (the same figures as held_out_error), refreshed by the
    # worker: a rising error is the group's hardware or software drifting from what the model learned.
    live_error = models.JSONField(default=dict)
    live_curves = models.JSONField(default=dict)  # as held_out_curves, on the latest traffic
    # {"decode": +0.35, "prefill": -0.02}: each cost's change at the same batch sizes, observed against the model's
    live_moved = models.JSONField(default=dict)
    live_requests = models.PositiveIntegerField(default=0)
    live_at = models.DateTimeField(null=True, blank=True)
    created_by = models.CharField(max_length=150, blank=True, default="")  # a user, or "schedule"
    cancel_requested = models.BooleanField(default=False)
    lease = models.CharField(max_length=32, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["project", "group", "-created_at"]), models.Index(fields=["state"])]

    def __str__(self) -> str:
        return f"engine model {self.id} ({self.group})"
