"""Under ``USE_TZ = False`` every moment djlocks hands out is naive local time, as
``timezone.now()`` is, and every operator's tool works: on each configured backend.

The project's ``TIME_ZONE`` is set far from UTC (UTC+05:30), so that a moment read in
the wrong zone is hours off, not within the tolerance.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.contrib.admin import site
from django.contrib.admin.utils import display_for_value
from django.core.management import call_command
from django.db import connections
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from djlocks import Lock, LockLost, NotAcquired
from djlocks.backends import backends
from djlocks.backends.base import LockBackend
from djlocks.keys import table_key
from djlocks.models import LeaseSlot, LeaseWaiter
from djlocks.table_admin import LeaseSlotAdmin, store_moment

pytestmark = pytest.mark.usefixtures("store")

#: UTC+05:30 all year: a moment read as UTC, or written as local, is 5.5 hours off.
FAR_FROM_UTC = "Asia/Kolkata"
#: How far from the test's ``timezone.now()`` a moment it just made may be, in seconds.
CLOSE = 60


@pytest.fixture
def local_time(settings: Any) -> Iterator[None]:
    """``USE_TZ = False`` in ``FAR_FROM_UTC``, with djlocks' connections opened under
    it (and closed before the project's own settings come back)."""
    settings.USE_TZ = False
    settings.TIME_ZONE = FAR_FROM_UTC
    backends.reset()
    yield
    backends.reset()


def assert_local_now(moment: datetime | None, what: str) -> None:
    assert moment is not None, f"{what} is missing"
    assert timezone.is_naive(moment), f"{what} is aware ({moment}) under USE_TZ = False"
    off = abs((moment - timezone.now()).total_seconds())
    assert off < CLOSE, f"{what} ({moment}) is {off:.0f} s from local now ({timezone.now()})"


def assert_utc_now(text: str, what: str) -> None:
    """``text``, a moment in JSON, says its zone (UTC) and is close to now."""
    assert text.endswith("Z"), f"{what} ({text}) has no zone"
    off = abs((datetime.fromisoformat(text) - datetime.now(UTC)).total_seconds())
    assert off < CLOSE, f"{what} ({text}) is {off:.0f} s from now"


def djlocks(*args: str) -> str:
    out = StringIO()
    call_command("djlocks", *args, stdout=out)
    return out.getvalue()


@pytest.fixture(params=list(settings.DJLOCKS["BACKENDS"]))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.usefixtures("local_time")
def test_moments_are_local_time_and_the_operators_tools_work(
    backend: str, admin_client: Client
) -> None:
    name = f"local-time:{backend}"
    store = backends[backend]
    waiter_ids: list[int] = []
    waiting = threading.Thread(target=_wait_for, args=(name, backend, waiter_ids), daemon=True)
    with Lock(name, backend=backend, ttl=30, label="local") as grant:
        assert_local_now(grant.acquired_at, "Grant.acquired_at")
        if store.capabilities.crash_release == "ttl":
            assert_local_now(grant.expires_at - timedelta(seconds=30), "Grant.expires_at - ttl")
        waiting.start()
        if store.capabilities.forced_release:  # (row locks on SQLite show no holder)
            _inspect(store, name, backend, waiter_ids)
        if store.capabilities.forced_release:
            shown = admin_client.get(
                reverse("admin:djlocks_name_json"), {"backend": backend, "name": name}
            ).json()
            assert_utc_now(shown["holders"][0]["since"], "name.json: since")
        for page in (
            reverse("admin:djlocks_lockname_changelist"),
            reverse("admin:djlocks_overview_json"),
            reverse("admin:djlocks_name") + f"?backend={backend}&name={name}",
            reverse("admin:djlocks_name_json") + f"?backend={backend}&name={name}",
            reverse("admin:djlocks_lockevent_changelist"),
        ):
            assert admin_client.get(page).status_code == 200, page
    waiting.join(timeout=20)
    assert not waiting.is_alive()
    if store.capabilities.cooldowns:
        until = store.set_cooldown(name, 0, 30)
        assert_local_now(until - timedelta(seconds=30), "set_cooldown's end - 30 s")
        store.set_cooldown(name, 0, 0)
    assert "default: 0 expired grants, 0 dead waiters" in djlocks("sweep").splitlines()


def _inspect(store: LockBackend, name: str, backend: str, waiter_ids: list[int]) -> None:
    """What the store, ``djlocks list`` and ``show`` say of ``name``'s holder and its
    waiter (``_wait_for``, whose thread id is in ``waiter_ids``), once it is queued."""
    deadline = time.monotonic() + 20
    while not store.waiters(name):
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.05)
    (holder,) = store.holders(name)
    assert_local_now(holder.since, "HolderInfo.since")
    if holder.expires_at is not None:
        assert_local_now(holder.expires_at - timedelta(seconds=30), "HolderInfo.expires_at - ttl")
    (waiter,) = store.waiters(name)
    assert_local_now(waiter.since, "WaiterInfo.since")
    assert waiter.thread.endswith(f"(tid {waiter_ids[0]})"), waiter.thread
    document = json.loads(djlocks("list", "--backend", backend, "--json"))
    assert_utc_now(document["holders"][0]["since"], "list --json: since")
    assert_utc_now(document["waiters"][0]["since"], "list --json: waiter's since")
    listed = djlocks("list", "--backend", backend)
    assert f"since {holder.since:%Y-%m-%d %H:%M:%S} {FAR_FROM_UTC}" in listed, listed
    assert f"since {waiter.since:%Y-%m-%d %H:%M:%S} {FAR_FROM_UTC}" in listed, listed
    assert f"since {holder.since:%Y-%m-%d %H:%M:%S}" in djlocks("show", name, "--backend", backend)


def _wait_for(name: str, backend: str, ids: list[int]) -> None:
    """Queue for ``name`` until its holder lets go (a waiter for the inspection); say
    which thread waits in ``ids``."""
    ids.append(threading.get_native_id())
    try:
        with Lock(name, backend=backend, ttl=30, timeout=20, label="waiting"):
            pass
    except NotAcquired:
        pass
    finally:
        connections.close_all()  # this thread's own


@pytest.mark.usefixtures("local_time")
def test_a_cooldown_and_an_expired_lease_are_judged_by_the_stores_clock() -> None:
    """The lease inspection and sweep compare the rows with the database's UTC clock:
    a cool-down is listed until it ends, an expired grant is swept, a live one is not."""
    store = backends["default"]
    with Lock("local-time:cool", cooldown=30):
        pass
    (cooling,) = store.cooldowns("local-time:cool")
    assert_local_now(cooling.until - timedelta(seconds=30), "CooldownInfo.until - cool-down")
    assert "cool-down until" in djlocks("list")

    expired = Lock("local-time:expired", ttl=0.3, renew=False).acquire_grant()
    assert expired is not None
    with Lock("local-time:live", ttl=30):
        time.sleep(0.5)
        assert [h.name for h in store.holders()] == ["local-time:live"]
        assert "default: 1 expired grants, 0 dead waiters" in djlocks("sweep").splitlines()
        assert [h.name for h in store.holders()] == ["local-time:live"]
    with pytest.raises(LockLost):
        expired.release()


@pytest.mark.usefixtures("local_time")
def test_the_lease_tables_pages_show_local_time_and_only_a_cooldown_that_lasts(
    admin_client: Client,
) -> None:
    """The admin's *Lease slots* and *Lease waiters*: the database wrote their moments by
    its UTC clock, which MySQL and SQLite keep as bare wall times. No page shows a
    token, nor lets a filter find one out."""
    name, store = "local-time:tables", backends["default"]
    waiter_ids: list[int] = []
    waiting = threading.Thread(target=_wait_for, args=(name, "default", waiter_ids), daemon=True)
    try:
        with Lock(name, backend="default", ttl=30, cooldown=60):
            waiting.start()
            deadline = time.monotonic() + 20
            while not store.waiters(name):
                assert time.monotonic() < deadline, "the waiter never queued"
                time.sleep(0.05)
            slot = LeaseSlot.objects.using(store.using).get(key=table_key(name))
            waiter = LeaseWaiter.objects.using(store.using).get(key=table_key(name))
            acquired, since = store_moment(slot, "acquired_at"), store_moment(waiter, "since")
            assert_local_now(acquired, "Lease slots: acquired at")
            assert_local_now(since, "Lease waiters: since")
            for model, row, moment in ((LeaseSlot, slot, acquired), (LeaseWaiter, waiter, since)):
                pages = f"admin:djlocks_{model._meta.model_name}"
                for page in (
                    reverse(f"{pages}_changelist"),
                    reverse(f"{pages}_change", args=[row.pk]),
                ):
                    shown = admin_client.get(page).content.decode()
                    assert display_for_value(moment, "-") in shown, f"{page} shows another time"
                    for token in (slot.token, waiter.token):
                        assert token and token not in shown, f"{page} shows a token"
                probe = admin_client.get(reverse(f"{pages}_changelist"), {"token__startswith": "a"})
                assert probe.status_code == 400, f"{pages} lets a filter find a token out"
        slot.refresh_from_db()
        cooling = store_moment(slot, "cooldown_until")
        assert_local_now(cooling - timedelta(seconds=60), "Lease slots: cool-down")
        slots = LeaseSlotAdmin(LeaseSlot, site)
        assert slots.cooldown(slot) == display_for_value(cooling, "-")
        slot.cooldown_until = timezone.now() - timedelta(days=1)  # as a slot keeps one
        assert slots.cooldown(slot) == slots.get_empty_value_display(), "a past one is shown"
    finally:
        store.set_cooldown(name, 0, 0)  # the waiter's turn
        waiting.join(timeout=20)
    assert not waiting.is_alive()
