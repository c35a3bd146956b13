"""Django admin views of alerts (read mostly) and silences."""
from django.contrib import admin

from .models import Alert, AlertTransition, Silence


class TransitionInline(admin.TabularInline):
    model = AlertTransition
    extra = 0
    can_delete = False
    fields = ("at", "from_state", "to_state", "reason", "notified", "muted", "event_id", "delivery_ids")
    readonly_fields = fields


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = ("fingerprint", "project", "kind", "severity", "state", "slo", "started_at", "fired_at",
                    "resolved_at")
    list_filter = ("state", "severity", "kind", "project")
    search_fields = ("fingerprint",)
    readonly_fields = ("fingerprint", "version", "episode", "started_at", "fired_at", "resolved_at",
                       "last_evaluated_at", "last_notified_at")
    inlines = [TransitionInline]


@admin.register(Silence)
class SilenceAdmin(admin.ModelAdmin):
    list_display = ("id", "project", "starts_at", "ends_at", "created_by_name", "comment")
    list_filter = ("project",)
