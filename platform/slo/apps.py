from django.apps import AppConfig


class SloConfig(AppConfig):
    name = "slo"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The per-SLO gauges are not registered here: /metrics adds them for an API token's projects only
        # (observatory.views.prometheus_metrics).
        from . import metrics  # noqa: F401  (the counters and histograms register on import)
