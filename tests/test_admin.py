"""The admin dashboard against the real store: what it shows (the store's own holders
and waiters, never a copy), who may see and do what, the confirmed and audited forced
release, history, JSON."""

from __future__ import annotations

import html
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from djlocks import LockLost, db_lock, db_rwlock, db_semaphore, leadership
from djlocks.backends import backends
from djlocks.backends.base import HolderInfo
from djlocks.events import USUAL_EVIDENCE, events
from djlocks.models import LeaseSlot, LockEvent
from djlocks.runlocked import EXIT_LOST
from djlocks.table_admin import duration_text
from tests.processes import finished, runlocked, wait_for_file, wait_until_dead
from tests.test_reliability import LEASES
from tests.workers import CONTEXT, start_worker, wait_in_line

pytestmark = pytest.mark.usefixtures("store")

OVERVIEW = "/admin/djlocks/lockname/"
LEASE_BACKEND = "djlocks.backends.lease.LeaseBackend"


def name_url(name: str, backend: str = "default", **extra: object) -> str:
    return (
        reverse("admin:djlocks_name") + "?" + urlencode({"backend": backend, "name": name, **extra})
    )


def release_url(name: str, backend: str = "default", **extra: object) -> str:
    query = urlencode({"backend": backend, "name": name, **extra})
    return reverse("admin:djlocks_release") + "?" + query


def staff(*codenames: str) -> Client:
    """A logged-in staff user holding exactly the given djlocks permissions."""
    user = User.objects.create_user(f"staff-{'-'.join(codenames) or 'none'}", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="djlocks", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def wait_for(condition: Callable[[], bool], seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition never became true"
        time.sleep(0.05)


def test_the_dashboard_is_in_the_admin_index(admin_client: Client) -> None:
    index = admin_client.get("/admin/").content.decode()
    assert OVERVIEW in index and "Locks and semaphores" in index


#: Backends whose holders and waiters the dashboard shows (the row backend's are
#: in tests/test_row_backend.py).
SHOWN = [*LEASES] + ([] if connection.vendor == "sqlite" else ["session"])


@pytest.mark.catalogue("admin-matches-store")
@pytest.mark.parametrize("backend", SHOWN)
def test_the_admin_matches_the_store(admin_client: Client, backend: str) -> None:
    """One holder and two waiters on a lock, 2 of 3 slots of a semaphore: all shown,
    with host, pid, since and, for a lease, its expiry."""
    report = CONTEXT.Queue()
    with (
        db_lock("admin:lock", label="nightly import", timeout=0, backend=backend) as grant,
        db_semaphore("admin:sem", limit=3, timeout=0, label="render a", backend=backend),
        db_semaphore("admin:sem", limit=3, timeout=0, label="render b", backend=backend),
    ):
        waiters = [
            start_worker(wait_in_line, "admin:lock", f"waiter {i}", report, backend) for i in (1, 2)
        ]
        wait_for(lambda: len(backends[backend].waiters("admin:lock")) == 2)

        overview = admin_client.get(OVERVIEW).content.decode()
        assert "admin:lock" in overview and "admin:sem" in overview
        assert "1 / 1" in overview and "2 / 3" in overview and "semaphore of 3" in overview

        page = admin_client.get(name_url("admin:lock", backend)).content.decode()
        assert "nightly import" in page and str(os.getpid()) in page and str(grant.fence) in page
        if backend in LEASES:
            assert grant.expires_at is not None and "data-countdown" in page
        for worker in waiters:
            assert str(worker.pid) in page
        data = admin_client.get(
            name_url("admin:lock", backend).replace("/name/", "/name.json")
        ).json()
        (holder,) = data["holders"]
        assert holder["pid"] == os.getpid() and holder["fence"] == grant.fence
        assert holder["host"] and holder["since"]
        assert holder["expires_in"] > 0 if backend in LEASES else holder["expires_in"] is None
        assert "token" not in holder
        assert [w["position"] for w in data["waiters"]] == [0, 1]
        assert {w["pid"] for w in data["waiters"]} == {w.pid for w in waiters}
        assert all(w["host"] and w["since"] for w in data["waiters"])

        semaphore = admin_client.get(
            name_url("admin:sem", backend).replace("/name/", "/name.json")
        ).json()
        assert sorted(h["label"] for h in semaphore["holders"]) == ["render a", "render b"]
        assert semaphore["limit"] == 3
    for worker in waiters:
        worker.join(30)
        assert worker.exitcode == 0


def test_search_filters_sorting_and_pagination(admin_client: Client) -> None:
    for number in range(105):
        with db_lock(f"page:{number:03}", timeout=0):
            pass
    with db_lock("page:held", label="the-one-label", timeout=0):
        listing = admin_client.get(reverse("admin:djlocks_overview_json") + "?q=page:").json()
        assert listing["count"] == 106 and listing["pages"] == 2 and len(listing["rows"]) == 100
        second = admin_client.get(reverse("admin:djlocks_overview_json") + "?q=page:&page=2")
        assert len(second.json()["rows"]) == 6
        by_label = admin_client.get(reverse("admin:djlocks_overview_json") + "?q=one-label")
        assert [row["name"] for row in by_label.json()["rows"]] == ["page:held"]
        held = admin_client.get(reverse("admin:djlocks_overview_json") + "?state=held").json()
        assert [row["name"] for row in held["rows"]] == ["page:held"]
        free = admin_client.get(reverse("admin:djlocks_overview_json") + "?state=free").json()
        assert free["count"] == 105
        backward = admin_client.get(reverse("admin:djlocks_overview_json") + "?q=page:&o=-name")
        assert backward.json()["rows"][0]["name"] == "page:held"
        page = admin_client.get(OVERVIEW + "?q=page:&page=2").content.decode()
        assert "page:104" in page and "page:000" not in page
    assert admin_client.get(OVERVIEW + "?backend=nowhere").status_code == 404


def test_permissions() -> None:
    with db_lock("perm:lock", timeout=0):
        anonymous = Client()
        assert anonymous.get(OVERVIEW).status_code == 302  # to the admin login
        assert anonymous.get(reverse("admin:djlocks_overview_json")).status_code == 302

        nobody = staff()
        assert nobody.get(OVERVIEW).status_code == 403
        assert nobody.get(name_url("perm:lock")).status_code == 403
        assert nobody.get(reverse("admin:djlocks_overview_json")).status_code == 403
        assert "Locks and semaphores" not in nobody.get("/admin/").content.decode()

        viewer = staff("view_lockname")
        page = viewer.get(name_url("perm:lock"))
        assert page.status_code == 200 and "Release…" not in page.content.decode()
        assert (
            "release_url"
            not in viewer.get(name_url("perm:lock").replace("/name/", "/name.json")).json()[
                "holders"
            ][0]
        )
        assert viewer.get(release_url("perm:lock")).status_code == 403
        refused = viewer.post(release_url("perm:lock"), {"fences": "1", "reason": "x"})
        assert refused.status_code == 403
        assert backends["default"].holders("perm:lock"), "a viewer released it"


def test_forced_release_needs_csrf(admin_user: User) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    with db_lock("csrf:lock", timeout=0) as grant:
        refused = client.post(release_url("csrf:lock"), {"fences": str(grant.fence), "reason": "x"})
        assert refused.status_code == 403
        grant.check()  # still held


@pytest.mark.catalogue("forced-release", backend="default")
def test_confirmed_forced_release_is_audited_and_the_holder_learns(admin_client: Client) -> None:
    lock = db_lock("force:lock", label="stuck job", timeout=0)
    grant = lock.acquire_grant()
    assert grant is not None
    confirm = admin_client.get(release_url("force:lock", fence=grant.fence)).content.decode()
    assert (
        "stuck job" in confirm
        and "fence superseded" in confirm
        and "csrfmiddlewaretoken" in confirm
    )
    assert backends["default"].holders("force:lock"), "GET must not release"

    missing_reason = admin_client.post(
        release_url("force:lock", fence=grant.fence), {"fences": str(grant.fence), "reason": ""}
    )
    assert missing_reason.status_code == 200 and backends["default"].holders("force:lock")

    done = admin_client.post(
        release_url("force:lock", fence=grant.fence),
        {"fences": str(grant.fence), "reason": "the job hung on a dead NFS mount"},
    )
    assert done.status_code == 302 and done["Location"] == name_url("force:lock")
    assert backends["default"].holders("force:lock") == []
    with pytest.raises(LockLost):
        grant.check()
    with pytest.raises(LockLost):
        lock.release()

    (entry,) = LogEntry.objects.filter(object_id="force:lock")
    assert entry.user.username == "admin" and "dead NFS mount" in entry.get_change_message()
    assert f"fence {grant.fence}" in entry.get_change_message()
    forced = LockEvent.objects.get(name="force:lock", kind="forced_release")
    assert forced.operator == "admin" and forced.reason == "the job hung on a dead NFS mount"
    assert forced.fence == grant.fence
    kinds = set(LockEvent.objects.filter(name="force:lock").values_list("kind", flat=True))
    assert kinds == {"forced_release", "acquired", "lost"}


def test_only_the_grants_shown_are_released(admin_client: Client) -> None:
    """A holder that took over between the confirmation and the POST is left alone: a forced
    release fences the holder that was shown, and only that one."""
    first = db_lock("shown:lock", timeout=0).acquire_grant()
    assert first is not None
    shown_fence = first.fence
    first.release()
    with db_lock("shown:lock", timeout=0) as newer:
        answer = admin_client.post(
            release_url("shown:lock"), {"fences": str(shown_fence), "reason": "stale page"}
        )
        assert answer.status_code == 302
        newer.check()
    assert not LogEntry.objects.filter(object_id="shown:lock").exists()


def test_cooldown_can_be_cleared_and_extended(admin_client: Client) -> None:
    with db_semaphore("cool:sem", limit=2, cooldown=300, timeout=0):
        pass
    page = admin_client.get(name_url("cool:sem")).content.decode()
    assert "Clear or change" in page
    (cooling,) = backends["default"].cooldowns("cool:sem")
    url = (
        reverse("admin:djlocks_cooldown")
        + "?"
        + urlencode({"backend": "default", "name": "cool:sem", "slot": cooling.slot})
    )
    assert "may not be granted again" in admin_client.get(url).content.decode()
    assert admin_client.post(url, {"seconds": "0", "reason": "deploy done"}).status_code == 302
    assert backends["default"].cooldowns("cool:sem") == []
    assert admin_client.post(url, {"seconds": "600", "reason": "hold off"}).status_code == 302
    (extended,) = backends["default"].cooldowns("cool:sem")
    # 600 s from the extension's now, against 300 s from the release's now.
    assert 290 < (extended.until - cooling.until).total_seconds() < 400
    assert LogEntry.objects.filter(object_id="cool:sem").count() == 2
    changes = LockEvent.objects.filter(name="cool:sem", kind="cooldown_changed")
    assert changes.count() == 2 and changes.filter(operator="admin").count() == 2
    assert admin_client.post(url, {"seconds": "-1", "reason": "x"}).status_code == 200  # refused


def test_history_records_and_statistics(admin_client: Client) -> None:
    for _ in range(3):
        with db_lock("hist:lock", timeout=0):
            time.sleep(0.02)
    with db_lock("hist:lock", timeout=0):
        assert not db_lock("hist:lock").acquire(timeout=0.05)
    assert events.flush()  # the background writer has them
    kinds = list(LockEvent.objects.filter(name="hist:lock").values_list("kind", flat=True))
    assert sorted(kinds) == sorted(["acquired"] * 4 + ["released"] * 4 + ["timed_out"])
    data = admin_client.get(name_url("hist:lock").replace("/name/", "/name.json")).json()
    stats = data["statistics"]
    assert stats["acquisitions"] == 4 and stats["timed_out"] == 1
    assert stats["hold_median"] >= 0.02 and stats["hold_p95"] >= stats["hold_median"]
    assert stats["wait_median"] is not None
    assert data["events"][0]["kind"] == "released"
    page = admin_client.get(name_url("hist:lock", period="1h")).content.decode()
    assert "Recent events" in page and "timed out" in page


def test_a_holder_held_far_past_its_names_usual_hold_is_marked_stuck_and_shown_first(
    admin_client: Client,
) -> None:
    for _ in range(USUAL_EVIDENCE):  # the history: short holds
        with db_lock("stuck:job", timeout=0):
            pass
    assert events.flush()
    with (
        db_lock("stuck:job", timeout=0),
        db_lock("fresh:job", timeout=0),
        db_lock("new:job", timeout=0),
    ):
        # Ten minutes on: the store's rows as two long holds leave them (one name has
        # no history, so no usual hold to be far past).
        long_ago = timezone.now() - timedelta(minutes=10)
        LeaseSlot.objects.filter(name__in=["stuck:job", "new:job"]).update(acquired_at=long_ago)
        overview = admin_client.get(reverse("admin:djlocks_overview_json")).json()
        assert overview["rows"][0]["name"] == "stuck:job", "stuck ones first"
        states = {row["name"]: row["states"] for row in overview["rows"]}
        assert states["stuck:job"][0] == "stuck" and "stuck" not in states["new:job"]
        assert "stuck" not in states["fresh:job"]
        only = admin_client.get(reverse("admin:djlocks_overview_json") + "?state=stuck").json()
        assert [row["name"] for row in only["rows"]] == ["stuck:job"]
        data = admin_client.get(name_url("stuck:job").replace("/name/", "/name.json")).json()
        holder = data["holders"][0]
        assert holder["stuck"] and 0 <= holder["usual_hold"] < 1 and holder["held_for"] > 590
        page = admin_client.get(name_url("stuck:job")).content.decode()
        assert 'class="djlocks-stuck">stuck: usually held' in page
        page = admin_client.get(name_url("new:job")).content.decode()
        assert "stuck: usually held" not in page


def test_a_names_page_draws_its_last_hour_and_the_overview_its_waiters(
    admin_client: Client,
) -> None:
    for _ in range(3):
        with db_lock("chart:job", timeout=0):
            time.sleep(0.02)
    with db_lock("chart:job", timeout=0, label="the holder"):
        assert not db_lock("chart:job").acquire(timeout=0.3)  # a wait that timed out
        assert events.flush()
        page = admin_client.get(name_url("chart:job")).content.decode()
        overview = admin_client.get(reverse("admin:djlocks_overview_json")).json()
    timeline = page[page.index('aria-label="timeline of grants and waits"') :]
    timeline = timeline[: timeline.index("</svg>")]
    assert timeline.count("<title>fence ") == 3 + 1, "three ended grants and the held one"
    assert timeline.count(", released</title>") == 3
    assert "(the holder)</title>" in timeline and "timed out: waited 0.3" in timeline
    assert "slot 0" in timeline and ">now<" in timeline
    # The held grant's acquire is written with its end: 3 acquires and the time-out.
    assert 'aria-label="Waits"' in page and "Waits (4 in all)" in page
    assert 'aria-label="Holds"' in page and "Holds (3 in all)" in page
    row = next(row for row in overview["rows"] if row["name"] == "chart:job")
    points = row["sparkline"].split('points="')[1].split('"')[0].split()
    heights = {float(point.split(",")[1]) for point in points}
    assert len(points) == 30 and len(heights) > 1, "the wait shows in the last point(s)"


def test_a_backend_on_a_database_that_is_not_configured_is_named_and_the_rest_shown(
    admin_client: Client, settings: Any
) -> None:
    """A backend whose ``using`` names no database (``djlocks.E005``) is listed as
    unusable on the overview, its JSON and ``djlocks list``, and left out of ``djlocks
    sweep``; the others are shown and swept."""
    settings.DJLOCKS = {
        **settings.DJLOCKS,
        "BACKENDS": {
            **settings.DJLOCKS["BACKENDS"],
            "elsewhere": {"BACKEND": LEASE_BACKEND, "OPTIONS": {"using": "not-configured"}},
        },
    }
    backends.reset()
    try:
        with db_lock("admin:still-shown"):
            assert "admin:still-shown" in admin_client.get(OVERVIEW).content.decode()
            data = admin_client.get(reverse("admin:djlocks_overview_json")).json()
            assert "not-configured" in data["unavailable"]["elsewhere"]
            asked = {"backend": "elsewhere", "name": "admin:still-shown"}
            page = admin_client.get(reverse("admin:djlocks_name"), asked)
            assert page.status_code == 200 and "not-configured" in page.content.decode()
            named = admin_client.get(reverse("admin:djlocks_name_json"), asked).json()
            assert "not-configured" in named["unavailable"]["elsewhere"]
            assert [row["name"] for row in data["rows"]] == ["admin:still-shown"]
            out = StringIO()
            with pytest.raises(CommandError) as unusable:
                call_command("djlocks", "list", "--skip-checks", stdout=out, stderr=StringIO())
            assert unusable.value.returncode == 69
            assert "admin:still-shown" in out.getvalue()
            out = StringIO()
            with pytest.raises(CommandError) as unswept:
                call_command("djlocks", "sweep", "--skip-checks", stdout=out, stderr=StringIO())
            assert unswept.value.returncode == 69
            assert "default: 0 expired grants, 0 dead waiters" in out.getvalue().splitlines()
    finally:
        backends.reset()


def test_the_events_list_filters_by_date_in_any_time_zone(
    admin_client: Client, settings: Any
) -> None:
    """Under a TIME_ZONE other than UTC the events list and its date filter work on
    every database, MySQL without its time-zone tables too (a date_hierarchy had the
    database convert times there, and the page failed)."""
    settings.TIME_ZONE = "Europe/Paris"
    now = timezone.now()
    for name, at in (("event-of-today", now), ("event-of-last-month", now - timedelta(days=30))):
        LockEvent.objects.create(at=at, kind="released", backend="default", name=name)
    page = reverse("admin:djlocks_lockevent_changelist")
    listed = admin_client.get(page)
    assert listed.status_code == 200
    shown = listed.content.decode()
    assert "event-of-today" in shown and "event-of-last-month" in shown
    past_week = re.search(r'href="(\?[^"]*at__gte[^"]*)"[^>]*>Past 7 days<', shown)
    assert past_week is not None, "no 'Past 7 days' filter"
    week = admin_client.get(page + html.unescape(past_week.group(1)))
    assert week.status_code == 200
    shown = week.content.decode()
    assert "event-of-today" in shown and "event-of-last-month" not in shown


def test_history_can_be_switched_off(settings: Any) -> None:
    settings.DJLOCKS = {**settings.DJLOCKS, "EVENTS": False}
    with db_lock("quiet:lock", timeout=0):
        pass
    assert events.flush()
    assert not LockEvent.objects.filter(name="quiet:lock").exists()


def test_unknown_or_malformed_targets_are_404(admin_client: Client) -> None:
    assert admin_client.get(name_url("x", backend="nowhere")).status_code == 404
    assert admin_client.get(name_url("")).status_code == 404
    assert admin_client.get(name_url("x" * 300)).status_code == 404


def test_a_runlocked_holder_released_in_the_admin_stops_its_command(
    admin_client: Client, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    script = f"echo $$ > {pid_file}; exec sleep 60"
    wrapper = runlocked(
        "admin:cron", "--ttl", "1.5", "--label", "nightly", "--", "sh", "-c", script
    )
    command = int(wait_for_file(pid_file))
    (holder,) = backends["default"].holders("admin:cron")
    assert holder.label == "nightly"
    answer = admin_client.post(
        release_url("admin:cron", fence=holder.fence),
        {"fences": str(holder.fence), "reason": "stuck since last night"},
    )
    assert answer.status_code == 302
    assert finished(wrapper) == EXIT_LOST
    wait_until_dead(command, timeout=5)


def test_sweep_records_expired_leases_and_prunes_old_history(settings: Any) -> None:
    lock = db_lock("sweep:lock", ttl=0.3, renew=False, label="crashed job")
    grant = lock.acquire_grant()
    assert grant is not None
    time.sleep(0.5)
    LockEvent.objects.create(
        at=timezone.now() - timedelta(days=30), kind="released", backend="default", name="sweep:old"
    )
    settings.DJLOCKS = {**settings.DJLOCKS, "EVENTS_RETENTION": 7 * 24 * 3600}
    output = StringIO()
    call_command("djlocks", "sweep", stdout=output)
    assert "1 expired grants" in output.getvalue() and "1 event(s)" in output.getvalue()
    expired = LockEvent.objects.get(name="sweep:lock", kind="expired")
    assert expired.label == "crashed job" and expired.fence == grant.fence
    assert 0.2 < (expired.held or 0) < 0.5
    assert not LockEvent.objects.filter(name="sweep:old").exists()
    with pytest.raises(LockLost):
        lock.release()


def every_admin_page(backend: str, name: str, holder: HolderInfo) -> list[str]:
    """Each page and JSON view of djlocks in the admin about ``name`` on ``backend`` and
    its ``holder``: the dashboard's, and each registered model's list, change, history
    and delete pages for every row."""
    query = {"backend": backend, "name": name}
    pages = ["/admin/", "/admin/djlocks/", OVERVIEW, reverse("admin:djlocks_overview_json")]
    pages += [name_url(name, backend), name_url(name, backend).replace("/name/", "/name.json")]
    pages += [release_url(name, backend), release_url(name, backend, fence=holder.fence)]
    pages += [reverse("admin:djlocks_cooldown") + "?" + urlencode({**query, "slot": holder.slot})]
    for model in admin.site._registry:
        if model._meta.app_label != "djlocks" or not model._meta.managed:
            continue  # LockName has no table: its pages are the dashboard's
        route = f"admin:djlocks_{model._meta.model_name}"
        pages.append(reverse(f"{route}_changelist"))
        for pk in model._default_manager.values_list("pk", flat=True):
            pages += [reverse(f"{route}_{view}", args=[pk]) for view in ("change", "history")]
            pages.append(reverse(f"{route}_delete", args=[pk]))
    return pages


@pytest.mark.parametrize("backend", SHOWN)
def test_no_admin_page_shows_a_token(admin_client: Client, backend: str) -> None:
    """A grant's token lets its bearer release it: no admin page or JSON view shows one,
    with a live grant, a waiter, a cool-down and history to show."""
    with db_lock("leak:old", backend=backend, timeout=0):
        pass
    assert events.flush()
    report = CONTEXT.Queue()
    waiter = None
    try:
        with db_lock("leak:lock", label="secret keeper", timeout=0, backend=backend):
            waiter = start_worker(wait_in_line, "leak:lock", "waiter", report, backend)
            wait_for(lambda: len(backends[backend].waiters("leak:lock")) == 1)
            (holder,) = backends[backend].holders("leak:lock")
            secret = holder.token.split(".")[0]  # a Redis token is "<secret>.<slot>"
            assert len(secret) >= 16
            shown = 0
            for page in every_admin_page(backend, "leak:lock", holder):
                answer = admin_client.get(page)
                assert answer.status_code in (200, 403), page  # 403: rows cannot be deleted
                text = answer.content.decode()
                assert secret not in text, f"{page} shows the token"
                shown += "secret keeper" in text
            assert shown >= 4, "the pages show the grant (its label), only never its token"
    finally:
        if waiter is not None:
            waiter.join(30)
    assert waiter.exitcode == 0


@pytest.mark.parametrize("backend", SHOWN)
def test_leaderships_are_shown_apart_with_their_leader_term_and_standbys(
    admin_client: Client, backend: str
) -> None:
    leader = leadership("scheduler", backend=backend, label="beat on web-1").start()
    standby = leadership("scheduler", backend=backend, label="beat on web-2")
    try:
        assert leader.wait_until_leader(10)
        standby.start()
        wait_for(lambda: len(leader.standbys()) == 1)
        data = admin_client.get(reverse("admin:djlocks_overview_json")).json()
        (shown,) = [row for row in data["leaderships"] if row["backend"] == backend]
        assert shown["name"] == "scheduler" and shown["term"] == leader.term
        assert f"pid {os.getpid()} (beat on web-1)" in shown["leader"]
        assert shown["standbys"] == 1 and "beat on web-2" in shown["standby_hosts"][0]
        assert not [row for row in data["rows"] if "scheduler" in row["name"]]
        page = admin_client.get(OVERVIEW).content.decode()
        assert "Leaderships" in page and "beat on web-1" in page
        url = reverse("admin:djlocks_overview_json")
        assert admin_client.get(url, {"q": "WEB-2"}).json()["leaderships"], "a standby's label"
        assert admin_client.get(url, {"q": "nowhere"}).json()["leaderships"] == []
    finally:
        standby.stop()
        leader.stop()
    data = admin_client.get(reverse("admin:djlocks_overview_json")).json()
    assert [row["leader"] for row in data["leaderships"] if row["backend"] == backend] in (
        [],
        [None],
    )


@pytest.mark.parametrize("backend", SHOWN)
def test_reader_writer_locks_are_shown_apart_with_their_readers_and_writer(
    admin_client: Client, backend: str
) -> None:
    rw = db_rwlock("catalogue", max_readers=3, backend=backend, label="importer")

    def shown() -> dict[str, Any]:
        data = admin_client.get(reverse("admin:djlocks_overview_json")).json()
        assert not [row for row in data["rows"] if "catalogue" in row["name"]]
        (row,) = [row for row in data["readers_writers"] if row["backend"] == backend]
        return dict(row)

    with rw.read(), rw.read():
        row = shown()
        assert (row["name"], row["readers"], row["writer"]) == ("catalogue", 2, None)
    with rw.write() as grant:
        row = shown()
        assert row["readers"] == 0 and row["writer_fence"] == grant.fence
        assert f"pid {os.getpid()} (importer)" in row["writer"]
        assert "Reader-writer locks" in admin_client.get(OVERVIEW).content.decode()


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.0, "0.0 ms"),
        (0.00234, "2.3 ms"),
        (0.9994, "999.4 ms"),
        (0.99996, "1.0 s"),
        (75, "1 min 15 s"),
    ],
)
def test_the_history_shows_waits_and_holds_in_milliseconds_below_a_second(
    seconds: float, shown: str
) -> None:
    assert duration_text(seconds) == shown


def test_an_event_shows_its_wait_and_hold_as_durations(admin_client: Client) -> None:
    with db_lock("admin:event-durations"):
        pass
    assert events.flush()
    event = LockEvent.objects.filter(name="admin:event-durations", kind="released").get()
    assert event.held is not None and event.held < 1
    page = admin_client.get(reverse("admin:djlocks_lockevent_change", args=[event.pk]))
    assert duration_text(event.held) in page.content.decode()
    assert repr(event.held) not in page.content.decode(), "the raw float is shown"
