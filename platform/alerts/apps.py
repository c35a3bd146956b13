from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "alerts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from slo.metrics import register_collector

        from . import metrics

        register_collector(metrics.AlertsCollector)
