from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "rollouts"
    verbose_name = "Config rollouts: regression gate, canary analysis, promotion or rollback"
    default_auto_field = "django.db.models.BigAutoField"
