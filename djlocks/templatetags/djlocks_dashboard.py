"""Template filters of the dashboard; ``static/djlocks/dashboard.js`` formats the same way."""

from __future__ import annotations

from datetime import datetime

from django import template

from djlocks.moments import as_utc

register = template.Library()


@register.filter
def seconds(value: float | None) -> str:
    """A duration in seconds for people: ``4.2 s``, ``3 min 5 s``, ``2 h 10 min``, ``3 d 4 h``.

    ``None`` is shown as an em dash; a negative value as ``overdue by ...``.
    """
    if value is None:
        return "—"
    if value < 0:
        return f"overdue by {seconds(-value)}"
    if value < 10:
        return f"{value:.1f} s"
    whole = int(value)
    for unit, size, smaller, smaller_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "min", 60),
        ("min", 60, "s", 1),
    ):
        if whole >= size:
            return f"{whole // size} {unit} {whole % size // smaller_size} {smaller}"
    return f"{whole} s"


@register.filter
def utc(value: datetime | None) -> str:
    """A datetime as ``YYYY-MM-DD HH:MM:SS`` in UTC (an em dash for ``None``); a naive one
    is in the project's time (``moments.as_utc``)."""
    return "—" if value is None else as_utc(value).strftime("%Y-%m-%d %H:%M:%S")
