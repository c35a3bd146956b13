from django.apps import AppConfig


class RegressionsConfig(AppConfig):
    name = "regressions"
    verbose_name = "Golden datasets and regression runs"
    default_auto_field = "django.db.models.BigAutoField"
