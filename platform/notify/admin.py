"""Django admin for channels and the delivery log; secrets are never displayed, only their first characters."""
from django.contrib import admin, messages

from . import signing
from .channels import SIGNED_KINDS, redact_url, secret_hint
from .models import Channel, Delivery, DeliveryAttempt


@admin.register(Channel)
class ChannelAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "kind", "shown_url", "enabled", "disabled_reason", "last_error_at",
                    "last_success_at")
    list_filter = ("kind", "enabled", "project")
    exclude = ("secrets",)
    readonly_fields = ("secret_hints", "last_error", "last_error_at", "last_success_at", "created_at", "updated_at")

    @admin.display(description="url")
    def shown_url(self, obj: Channel) -> str:
        return redact_url(obj.url, obj.kind)

    @admin.display(description="secrets")
    def secret_hints(self, obj: Channel) -> str:
        return ", ".join(secret_hint(s) for s in obj.secrets) or "-"

    def save_model(self, request, obj: Channel, form, change) -> None:
        new_secret = None
        if obj.kind in SIGNED_KINDS and not obj.secrets:
            new_secret = signing.generate_secret()
            obj.secrets = [new_secret]
        super().save_model(request, obj, form, change)
        if new_secret:
            messages.warning(request, f"Signing secret for {obj.name} (shown once): {new_secret}")


class DeliveryAttemptInline(admin.TabularInline):
    model = DeliveryAttempt
    extra = 0
    can_delete = False
    readonly_fields = ("number", "started_at", "duration_ms", "outcome", "status_code", "error", "url",
                       "response_excerpt")


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ("id", "channel", "event_id", "status", "attempts", "next_attempt_at", "last_status_code",
                    "is_test", "created_at")
    list_filter = ("status", "is_test")
    readonly_fields = ("uid", "event", "event_id", "fingerprint", "attempts", "claim_token", "lease_expires_at",
                       "last_status_code", "last_error", "last_duration_ms", "created_at", "updated_at",
                       "delivered_at")
    inlines = [DeliveryAttemptInline]
