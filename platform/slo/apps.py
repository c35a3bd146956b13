from django.apps import AppConfig


class SloConfig(AppConfig):
    name = "slo"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import metrics

        metrics.register_collector(metrics.SloCollector)
