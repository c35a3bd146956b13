from django.apps import AppConfig


class LoopsConfig(AppConfig):
    name = "loops"
    verbose_name = "The closed loop: from a page to a promoted config, on a leash"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: the trigger imports models, which need the registry ready() comes after.
        from .trigger import connect

        connect()
