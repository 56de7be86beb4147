"""The public API's forms: exports, on_busy, aacquire()/arelease(), a grant's date."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

import djlocks
from djlocks import Lock, NotAcquired, NotHeld, Semaphore, background, db_lock, db_semaphore
from djlocks.conf import events_database
from djlocks.testing import use_locmem_backends

pytestmark = pytest.mark.usefixtures("store")


def test_every_exception_and_the_version_are_exported() -> None:
    for name in ("BackendUnavailable", "LockDeadlock", "LockError", "LockLost", "NotHeld"):
        assert name in djlocks.__all__ and issubclass(getattr(djlocks, name), Exception)
    assert djlocks.__version__ == importlib.metadata.version("djlocks")


def test_a_busy_decorated_call_raises_by_default() -> None:
    @db_lock("api:raise", timeout=0)
    def job() -> str:
        return "ran"

    with db_lock("api:raise"), pytest.raises(NotAcquired):
        job()
    assert job() == "ran"


def test_a_busy_decorated_call_is_skipped_with_on_busy_skip() -> None:
    calls: list[int] = []

    @db_semaphore("api:skip", limit=1, timeout=0.2, on_busy="skip")
    def job(number: int) -> int:
        calls.append(number)
        return number

    with db_lock("api:skip"):
        assert job(1) is None
    assert job(2) == 2
    assert calls == [2], "a skipped call never runs"
    assert not Lock("api:skip").locked(), "the decorated call released its grant"


def test_a_skipped_async_call_returns_none() -> None:
    @db_lock("api:async-skip", timeout=0, on_busy="skip")
    async def job() -> str:
        return "ran"

    with db_lock("api:async-skip"):
        assert asyncio.run(job()) is None
    assert asyncio.run(job()) == "ran"


def test_on_busy_skip_is_refused_where_it_cannot_be_honoured() -> None:
    with pytest.raises(ValueError, match="on_busy"):
        Lock("api:bad", on_busy="wait")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be skipped"), Lock("api:block", on_busy="skip"):
        pass


def test_an_exception_in_a_decorated_call_releases_the_grant() -> None:
    @db_lock("api:boom", timeout=1)
    def job() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        job()
    assert not Lock("api:boom").locked()


def test_aacquire_and_arelease_without_async_with() -> None:
    lock = Semaphore("api:async", limit=1, ttl=10)

    async def scenario() -> tuple[bool, bool, bool]:
        first = await lock.aacquire(timeout=1)
        second = await Lock("api:async").aacquire(timeout=0)
        await lock.arelease()
        third = await lock.aacquire(blocking=False)
        await lock.arelease()
        return first, second, third

    assert asyncio.run(scenario()) == (True, False, True)
    with pytest.raises(NotHeld):
        asyncio.run(lock.arelease())


@pytest.mark.parametrize("use_tz", [True, False])
def test_a_grant_is_dated_when_it_was_made_as_timezone_now_dates(
    settings: Any, use_tz: bool
) -> None:
    """``acquired_at`` (the history's date of the grant) is the moment of the grant, though
    built when first asked for: aware under the ``USE_TZ`` of then, naive local time
    without it. (On the in-memory backend: no database connection has to follow the
    setting.)"""
    settings.USE_TZ = use_tz
    before = timezone.now()
    with use_locmem_backends(), db_lock("api:dated", timeout=10) as grant:
        after = timezone.now()
        time.sleep(0.05)
    settings.USE_TZ = not use_tz  # what the grant's date follows is the setting at the grant
    assert (grant.acquired_at.tzinfo is not None) is use_tz
    assert before <= grant.acquired_at <= after


class HistoryElsewhere:
    """A router that writes djlocks' models to the ``history`` alias."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "history" if model._meta.app_label == "djlocks" else None


def test_the_history_is_where_the_routers_write_unless_its_database_is_named() -> None:
    """As the backends' ``using``: a project that routes djlocks' tables to a database of
    their own finds its history there without naming it again."""
    assert events_database() == "default"
    background.flush_all()  # no history of earlier tests is written meanwhile
    with override_settings(DATABASE_ROUTERS=[HistoryElsewhere()]):
        assert events_database() == "history"
        with override_settings(DJLOCKS={**settings.DJLOCKS, "EVENTS_DATABASE": "default"}):
            assert events_database() == "default"
