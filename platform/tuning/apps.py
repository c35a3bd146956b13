from django.apps import AppConfig


class TuningConfig(AppConfig):
    name = "tuning"
    verbose_name = "Auto-tuning of the engine's knobs"
    default_auto_field = "django.db.models.BigAutoField"
