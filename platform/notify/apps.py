from django.apps import AppConfig


class NotifyConfig(AppConfig):
    name = "notify"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.exceptions import ImproperlyConfigured

        from . import http_client, metrics

        metrics.register_backlog_collector()
        try:  # a malformed allow-list stops the platform at start, saying how to write it
            http_client.policy_from_settings()
        except http_client.AllowListError as exc:
            raise ImproperlyConfigured(str(exc)) from None
