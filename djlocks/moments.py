"""Moments (``datetime``) as the project's time-zone settings shape them, and as text.

djlocks hands every moment out (a grant's ``acquired_at`` and ``expires_at``, the
holders, waiters and cool-downs that the inspection lists) as
``django.utils.timezone.now()`` gives it in the project: aware (UTC) under
``USE_TZ = True``, naive local time (``TIME_ZONE``) under ``USE_TZ = False``. So a
moment compares with ``timezone.now()`` and saves into the project's own
``DateTimeField`` under either setting, as Django's time-zone documentation asks
of every datetime in a project. Text for people names the zone (``moment_text``);
JSON gives every moment in UTC (``MomentEncoder``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import overload

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone


@overload
def project_moment(moment: datetime) -> datetime: ...
@overload
def project_moment(moment: None) -> None: ...


def project_moment(moment: datetime | None) -> datetime | None:
    """``moment`` as ``timezone.now()`` gives moments: under ``USE_TZ = False``, an aware
    ``moment`` becomes naive local time (``TIME_ZONE``); a naive one is taken to be
    local time already. Under ``USE_TZ = True`` an aware ``moment`` is returned in UTC,
    and a naive one is taken to be UTC. ``None`` (no moment) stays ``None``."""
    if moment is None:
        return None
    if settings.USE_TZ:
        return moment.astimezone(UTC) if timezone.is_aware(moment) else moment.replace(tzinfo=UTC)
    if timezone.is_naive(moment):
        return moment
    return timezone.make_naive(moment, timezone.get_default_timezone())


def as_utc(moment: datetime) -> datetime:
    """``moment`` as an aware UTC datetime; a naive one is in the project's time (local
    time under ``USE_TZ = False``, UTC under ``USE_TZ = True``)."""
    if timezone.is_naive(moment):
        zone = UTC if settings.USE_TZ else timezone.get_default_timezone()
        moment = timezone.make_aware(moment, zone)
    return moment.astimezone(UTC)


def moment_text(moment: datetime, form: str = "%Y-%m-%d %H:%M:%S") -> str:
    """``moment`` written with ``form`` (``strftime``) and its time zone, which a bare
    time leaves to guesswork: ``UTC`` for an aware moment (shown in UTC), the
    project's ``TIME_ZONE`` for a naive one (local time, ``USE_TZ = False``)."""
    if timezone.is_naive(moment):
        return f"{moment:{form}} {settings.TIME_ZONE}"
    return f"{moment.astimezone(UTC):{form}} UTC"


class MomentEncoder(DjangoJSONEncoder):
    """Django's JSON encoder, which writes every moment in UTC with its zone: a naive
    moment (local time, ``USE_TZ = False``) would be read by a browser or a script as
    in its own zone."""

    def default(self, o: object) -> object:
        return super().default(as_utc(o) if isinstance(o, datetime) else o)
