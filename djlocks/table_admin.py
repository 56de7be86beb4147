"""Read-only admin pages of djlocks' own tables: the event history, the lease slots
and the lease queue.

The lease tables' moments are written by the database's own clock in UTC. A database
without time zones (MySQL, SQLite) keeps them as UTC wall times, which Django's admin
would show as if they were in the project's ``TIME_ZONE`` under ``USE_TZ = False``:
hours off, with no zone to tell. Their columns here read them as the lease backend
does (``sql.as_datetime``) and show them in the project's time
(``moments.project_moment``), as every other djlocks page does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.contrib import admin
from django.db import connections
from django.db.models import Model
from django.http import HttpRequest
from django.utils import timezone

from djlocks.backends.sql import as_datetime
from djlocks.models import LeaseSlot, LeaseWaiter, LockEvent
from djlocks.moments import project_moment
from djlocks.templatetags.djlocks_dashboard import seconds


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Rows written by djlocks only; the admin shows them."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


def store_moment(row: Model, field: str) -> datetime | None:
    """The moment ``field`` of ``row``, which the database's clock wrote in UTC, in the
    project's time; ``None`` where it is empty."""
    value = getattr(row, field)
    if value is None:
        return None
    return project_moment(as_datetime(value, connections[row._state.db or "default"]))


def moment_column(field: str, description: str) -> Callable[[admin.ModelAdmin, Model], object]:  # type: ignore[type-arg]
    """An admin column (and read-only field) showing ``store_moment`` of ``field``."""

    @admin.display(description=description, ordering=field)
    def column(self: admin.ModelAdmin, row: Model) -> datetime | None:  # type: ignore[type-arg]
        return store_moment(row, field)

    return column


def duration_text(value: float | None) -> str:
    """Seconds for people, to the tenth of a millisecond below one second (a lock's
    waits and holds are often a few milliseconds); longer ones as the dashboard shows
    them (``12.5 s``, ``3 min 5 s``)."""
    if value is not None and 0 <= value < 1:
        return f"{value * 1000:.1f} ms"
    return seconds(value)


@admin.register(LockEvent)
class LockEventAdmin(ReadOnlyAdmin):
    list_display = (
        "at",
        "kind",
        "backend",
        "name",
        "slot",
        "fence",
        "host",
        "pid",
        "label",
        "waited_for",
        "held_for",
        "operator",
    )
    # A date filter, not a date_hierarchy: the hierarchy has the database convert
    # times to TIME_ZONE, which MySQL cannot without its time-zone tables (the page
    # failed); the filter's ranges are computed here.
    list_filter = ("kind", "backend", "at")
    search_fields = ("name", "host", "label", "operator", "reason")
    ordering = ("-at",)

    @admin.display(description="waited", ordering="waited")
    def waited_for(self, event: LockEvent) -> str:
        return duration_text(event.waited)

    @admin.display(description="held", ordering="held")
    def held_for(self, event: LockEvent) -> str:
        return duration_text(event.held)


@admin.register(LeaseSlot)
class LeaseSlotAdmin(ReadOnlyAdmin):
    """The lease rows, without their owner tokens: a token lets its bearer release."""

    fields = readonly_fields = (
        "name",
        "key",
        "slot",
        "limit",
        "fence",
        "host",
        "pid",
        "thread",
        "label",
        "acquired",
        "expires",
        "cooldown",
        "release_by_moment",
    )
    list_display = (
        "name",
        "slot",
        "limit",
        "fence",
        "host",
        "pid",
        "label",
        "acquired",
        "expires",
        "cooldown",
    )
    search_fields = ("name", "host", "label")
    ordering = ("name", "slot")

    acquired = moment_column("acquired_at", "acquired at")
    expires = moment_column("expires_at", "expires at")
    release_by_moment = moment_column("release_by", "release by")

    @admin.display(description="cool-down until", ordering="cooldown_until")
    def cooldown(self, slot: LeaseSlot) -> datetime | None:
        """The end of the slot's cool-down, while it lasts: a past one holds nothing back."""
        until = store_moment(slot, "cooldown_until")
        return until if until is not None and until > timezone.now() else None


@admin.register(LeaseWaiter)
class LeaseWaiterAdmin(ReadOnlyAdmin):
    """The lease queue, without the waiters' tokens: a release hands a slot over with
    one, and its bearer could release that grant."""

    fields = readonly_fields = (
        "id",
        "name",
        "key",
        "host",
        "pid",
        "thread",
        "label",
        "waiting_since",
        "expires",
        "ttl",
        "slot_limit",
        "connection_id",
    )
    list_display = ("name", "id", "host", "pid", "label", "waiting_since", "expires")
    search_fields = ("name", "host", "label")
    ordering = ("name", "id")

    waiting_since = moment_column("since", "since")
    expires = moment_column("expires_at", "expires at")
