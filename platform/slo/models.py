"""The SLO definition (metadata DB) and the latest evaluation kept beside it; the status history lives in ClickHouse."""
from __future__ import annotations

import datetime as dt
import hashlib
import json

from django.db import models
from django.utils import timezone

from . import burn


class Sli(models.TextChoices):
    TTFT = "ttft_ms", "time to first token ≤ threshold"
    TPOT = "tpot_ms", "time per output token ≤ threshold"
    E2E = "e2e_ms", "end-to-end latency ≤ threshold"
    QUEUE = "queue_ms", "queue time ≤ threshold"
    ERROR_RATIO = "error_ratio", "share of requests that did not fail"
    ENGINE_MODEL_ERROR = "engine_model_error", "live checks of a group's engine model with |error| ≤ threshold"


LATENCY_SLIS = (Sli.TTFT, Sli.TPOT, Sli.E2E, Sli.QUEUE)
REQUEST_SLIS = (*LATENCY_SLIS, Sli.ERROR_RATIO)  # counted over request rows; engine_model_error counts model checks


class NoDataPolicy(models.TextChoices):
    OK = "ok", "no data is fine: nothing fires"
    KEEP = "keep", "keep the state of the last evaluation"
    ALERT = "alert", "no data is an alert (severity ticket)"


class SLO(models.Model):
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="slos")
    name = models.SlugField(max_length=100)
    description = models.TextField(blank=True, default="")
    sli = models.CharField(max_length=32, choices=Sli.choices)
    threshold_ms = models.FloatField(null=True, blank=True, help_text="latency SLIs only")
    threshold = models.FloatField(null=True, blank=True,
                                  help_text="engine_model_error only: the largest |relative error| of a good check, "
                                            "0 < threshold ≤ 1 (0.2 = 20%)")
    objective = models.FloatField(help_text="share of good requests, 0 < objective < 1 (0.99 = 99%)")
    period_days = models.PositiveSmallIntegerField(default=30, help_text="28 or 30")
    filters = models.JSONField(default=dict, blank=True,
                               help_text='{"service": [...], "model": [...], "prompt_bucket": [...], "engine_config": [...], '
                                         '"replica_group": [...]}')
    include_cached = models.BooleanField(
        default=False, help_text="also count requests the gateway answered from its response cache (served_from "
                                 "exact_cache | semantic_cache); off: engine-served requests only")
    tiers = models.JSONField(default=list, blank=True,
                             help_text='[{"name", "severity", "long_window", "short_window", "factor"}]; [] = defaults')
    min_requests = models.PositiveIntegerField(default=20, help_text="requests needed in a tier's long window")
    min_bad = models.PositiveIntegerField(default=3, help_text="bad requests needed in a tier's long window")
    no_data = models.CharField(max_length=8, choices=NoDataPolicy.choices, default=NoDataPolicy.OK)
    repeat_interval_seconds = models.PositiveIntegerField(default=4 * 3600,
                                                          help_text="repeat notifications of a firing alert")
    labels = models.JSONField(default=dict, blank=True, help_text="extra labels on this SLO's alerts")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    # The latest evaluation (the history is the ClickHouse table slo_status).
    last_evaluated_at = models.DateTimeField(null=True, blank=True)
    last_state = models.CharField(max_length=16, blank=True, default="")
    last_firing_tier = models.CharField(max_length=64, blank=True, default="")
    last_status = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="slo_name_unique_per_project")]
        ordering = ["project_id", "name"]
        verbose_name = "SLO"

    def __str__(self) -> str:
        return f"{self.project.name}/{self.name}" if self.project_id else self.name

    # -- typed views of the stored definition ------------------------------------------------------
    @property
    def period(self) -> dt.timedelta:
        return dt.timedelta(days=self.period_days)

    @property
    def burn_tiers(self) -> tuple[burn.BurnTier, ...]:
        if not self.tiers:
            return burn.DEFAULT_TIERS
        return tuple(
            burn.BurnTier(t["name"], t["severity"], burn.parse_window(t["long_window"]),
                          burn.parse_window(t["short_window"]), float(t["factor"]))
            for t in self.tiers
        )

    @property
    def repeat_interval(self) -> dt.timedelta:
        return dt.timedelta(seconds=self.repeat_interval_seconds)

    @property
    def sli_key(self) -> int:
        """Identifies what is counted (SLI, threshold, filters, cached traffic or not), not the objective: SLOs
        with the same SLI share their counts, and a changed threshold, filter or include_cached starts a new
        series."""
        return sli_key(self.sli, self.threshold_ms, self.filters, self.include_cached, self.threshold)


def sli_key(sli: str, threshold_ms: float | None, filters: dict, include_cached: bool = False,
            threshold: float | None = None) -> int:
    # include_cached and the ratio threshold join the canonical form only when set: an engine-only SLI keeps the key
    # (and the buckets) it had before response-cache hits existed, whose rows were all engine-served (served_from
    # 'engine'), and a request SLI the key it had before engine_model_error brought `threshold`.
    canonical = json.dumps(
        {"sli": sli, "threshold_ms": threshold_ms if sli in LATENCY_SLIS else None,
         "filters": {k: sorted(v) for k, v in sorted(filters.items()) if v},
         **({"include_cached": True} if include_cached else {}),
         **({"threshold": threshold} if sli == Sli.ENGINE_MODEL_ERROR else {})},
        sort_keys=True, separators=(",", ":"),
    )
    return int.from_bytes(hashlib.blake2b(canonical.encode(), digest_size=8).digest(), "big") >> 1  # fits Int64 too
