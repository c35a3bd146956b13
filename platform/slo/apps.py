from django.apps import AppConfig


class SloConfig(AppConfig):
    name = "slo"
    default_auto_field = "django.db.models.BigAutoField"
