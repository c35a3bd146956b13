from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "alerts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from slo.evaluation import on_evaluated
        from slo.metrics import register_collector

        from . import metrics
        from .lifecycle import apply_evaluation

        register_collector(metrics.AlertsCollector)
        on_evaluated(apply_evaluation)
