from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "rollouts"
    verbose_name = "Config rollouts: regression gate, canary analysis, promotion or rollback"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: the service imports models, which need the registry ready() comes after.
        from alerts.diagnosis import register_rollout_lookup

        from .service import rollouts_during

        # An alert's diagnosis names the rollouts running while the SLO burned: a canary is the first suspect.
        register_rollout_lookup(rollouts_during)
