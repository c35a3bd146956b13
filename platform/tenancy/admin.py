from django.contrib import admin

from .models import ApiToken, IngestKey, Membership, Project


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("name", "created_at", "retention_days")


@admin.register(IngestKey)
class IngestKeyAdmin(admin.ModelAdmin):
    list_display = ("display_prefix", "project", "name", "created_at", "revoked_at")
    readonly_fields = ("display_prefix", "key_hash")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("display_prefix", "user", "role", "created_at", "last_used_at", "revoked_at")
    readonly_fields = ("display_prefix", "token_hash")


admin.site.register(Membership)
