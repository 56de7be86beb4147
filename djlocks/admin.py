"""Read-only admin views of the lease tables; the operators' dashboard builds on them."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from djlocks.models import LeaseSlot, LeaseWaiter


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The store's rows are written by djlocks only; the admin shows them."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(LeaseSlot)
class LeaseSlotAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "slot",
        "limit",
        "fence",
        "host",
        "pid",
        "label",
        "acquired_at",
        "expires_at",
        "cooldown_until",
    )
    search_fields = ("name", "host", "label")
    ordering = ("name", "slot")


@admin.register(LeaseWaiter)
class LeaseWaiterAdmin(ReadOnlyAdmin):
    list_display = ("name", "id", "host", "pid", "label", "since", "expires_at")
    search_fields = ("name", "host", "label")
    ordering = ("name", "id")
