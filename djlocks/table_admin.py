"""Read-only admin pages of djlocks' own tables: the event history, the lease slots
and the lease queue.

The lease tables' moments are written by the database's own clock in UTC. A database
without time zones (MySQL, SQLite) keeps them as UTC wall times, which Django's admin
would show as if they were in the project's ``TIME_ZONE`` under ``USE_TZ = False``:
hours off, with no zone to tell. Their columns here read them as the lease backend
does (``sql.as_datetime``) and show them as the admin shows every other time: in the
current time zone (``TIME_ZONE`` unless activated otherwise). The tokens are never
shown, nor can a filter in the address (``?token__startswith=``) find them out.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.contrib import admin
from django.contrib.admin.utils import display_for_value
from django.db import connections, router
from django.db.models import Model
from django.http import HttpRequest
from django.utils import timezone

from djlocks.backends.sql import as_datetime
from djlocks.models import LeaseSlot, LeaseWaiter, LockEvent
from djlocks.moments import project_moment
from djlocks.templatetags.djlocks_dashboard import seconds as dashboard_seconds


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Rows written by djlocks only; the admin shows them."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class TokenHidingAdmin(ReadOnlyAdmin):
    """A table whose rows carry tokens, which let their bearer release a grant: the
    pages leave them out, and refuse a filter on them in the address, which would
    find one out a character at a time (``?token__startswith=a``)."""

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        return lookup.split("__")[0] != "token" and super().lookup_allowed(lookup, value, request)


def store_moment(row: Model, field: str) -> datetime | None:
    """The moment ``field`` of ``row``, which the database's clock wrote in UTC, in the
    project's time; ``None`` where it is empty."""
    value = getattr(row, field)
    if value is None:
        return None
    alias = row._state.db or router.db_for_read(type(row), instance=row)
    return project_moment(as_datetime(value, connections[alias]))


def moment_column(field: str, description: str) -> Callable[[admin.ModelAdmin, Model], str]:  # type: ignore[type-arg]
    """An admin column (and read-only field) showing ``store_moment`` of ``field`` as the
    admin shows times."""

    @admin.display(description=description, ordering=field)
    def column(self: admin.ModelAdmin, row: Model) -> str:  # type: ignore[type-arg]
        return str(display_for_value(store_moment(row, field), self.get_empty_value_display()))

    return column


def duration_text(seconds: float) -> str:
    """``seconds`` for people, to the tenth of a millisecond below one second (a lock's
    waits and holds are often a few milliseconds); longer ones as the dashboard shows
    them (``12.5 s``, ``3 min 5 s``)."""
    if 0 <= seconds < 0.99995:  # what rounds to 1000.0 ms is shown as 1.0 s
        return f"{seconds * 1000:.1f} ms"
    return str(dashboard_seconds(seconds))


@admin.register(LockEvent)
class LockEventAdmin(ReadOnlyAdmin):
    fields = readonly_fields = (
        "at",
        "kind",
        "backend",
        "name",
        "slot",
        "fence",
        "host",
        "pid",
        "thread",
        "label",
        "waited_for",
        "held_for",
        "operator",
        "reason",
    )
    list_display = tuple(field for field in fields if field not in ("thread", "reason"))
    # A date filter, not a date_hierarchy: the hierarchy has the database convert
    # times to TIME_ZONE, which MySQL cannot without its time-zone tables (the page
    # failed); the filter's ranges are computed here.
    list_filter = ("kind", "backend", "at")
    search_fields = ("name", "host", "label", "operator", "reason")
    ordering = ("-at",)

    @admin.display(description="waited", ordering="waited")
    def waited_for(self, event: LockEvent) -> str:
        return self._duration(event.waited)

    @admin.display(description="held", ordering="held")
    def held_for(self, event: LockEvent) -> str:
        return self._duration(event.held)

    def _duration(self, seconds: float | None) -> str:
        return str(self.get_empty_value_display()) if seconds is None else duration_text(seconds)


@admin.register(LeaseSlot)
class LeaseSlotAdmin(TokenHidingAdmin):
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
    list_display = tuple(
        field for field in fields if field not in ("key", "thread", "release_by_moment")
    )
    search_fields = ("name", "host", "label")
    ordering = ("name", "slot")

    acquired = moment_column("acquired_at", "acquired at")
    expires = moment_column("expires_at", "expires at")
    release_by_moment = moment_column("release_by", "release by")

    @admin.display(description="cool-down until", ordering="cooldown_until")
    def cooldown(self, slot: LeaseSlot) -> str:
        """The end of the slot's cool-down while it lasts (by this host's clock, which
        the database's may differ from by the clocks' skew): a past one holds nothing
        back."""
        until = store_moment(slot, "cooldown_until")
        lasting = until if until is not None and until > timezone.now() else None
        return str(display_for_value(lasting, self.get_empty_value_display()))


@admin.register(LeaseWaiter)
class LeaseWaiterAdmin(TokenHidingAdmin):
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
