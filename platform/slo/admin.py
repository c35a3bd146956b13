"""Django admin for SLOs: the same validation as the YAML and the API (definitions.validate)."""
from django import forms
from django.contrib import admin

from . import definitions
from .models import SLO


class SloForm(forms.ModelForm):
    class Meta:
        model = SLO
        fields = (
            "project", "name", "description", "sli", "threshold_ms", "threshold", "objective", "period_days", "filters",
            "include_cached", "tiers", "min_requests", "min_bad", "no_data", "repeat_interval_seconds", "labels",
            "enabled",
        )

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        definition = {
            "name": data.get("name"), "description": data.get("description") or "", "sli": data.get("sli"),
            "objective": data.get("objective"), "period": data.get("period_days"),
            "filters": data.get("filters") or {}, "include_cached": bool(data.get("include_cached")),
            "tiers": data.get("tiers") or "default",
            "min_requests": data.get("min_requests"), "min_bad": data.get("min_bad"), "no_data": data.get("no_data"),
            "repeat_interval": data.get("repeat_interval_seconds"), "labels": data.get("labels") or {},
            "enabled": data.get("enabled"),
        }
        for key in ("threshold_ms", "threshold"):
            if data.get(key) is not None:
                definition[key] = data[key]
        try:
            fields = definitions.validate(definition)
        except definitions.DefinitionError as exc:
            raise forms.ValidationError(exc.problems) from None
        data.update(fields)
        return data


@admin.register(SLO)
class SloAdmin(admin.ModelAdmin):
    form = SloForm
    list_display = ("name", "project", "sli", "threshold_ms", "threshold", "objective", "period_days", "enabled",
                    "last_state", "last_evaluated_at")
    list_filter = ("project", "sli", "enabled", "last_state")
    search_fields = ("name", "description")
    readonly_fields = ("created_at", "updated_at", "last_evaluated_at", "last_state", "last_firing_tier", "last_status")
