"""Bodies of worker processes started by the tests, and a one-off attempt from
another thread.

``start_worker`` passes the test databases' names and the environment as it is
then, so each child calls ``django.setup()`` against the same real test
database as the parent, with the settings the parent's environment gives it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tests.faults import TcpProxy

#: Workers are forked from a server process that has imported Django, the database
#: and Redis clients and djlocks once (``forkserver``), not started as new interpreters
#: (``spawn``): each starts in about 0.1 s, not 0.6 s. Neither inherits the parent's
#: threads, connections or configured Django; each calls ``django.setup()`` itself,
#: with the environment ``start_worker`` passes. A preloaded module that reads the
#: environment when imported (psycopg's PSYCOPG_IMPL) keeps the forkserver's: the
#: test process's as it was when its first worker started.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(
    ["django.db", "django.contrib.admin", "psycopg", "MySQLdb", "django_redis", "djlocks"]
)
#: A forked child ends with ``os._exit()``, past the interpreter's exit handlers (the
#: background writers' last flush among them); a ``spawn`` child ends like a program.
ENDS_LIKE_A_PROGRAM = multiprocessing.get_context("spawn")


def acquired_in_another_thread(lock: Any) -> bool:
    """Whether ``lock`` (a ``djlocks.Lock``) is granted at once to a new thread, which
    gives it back at once: another holder as far as the backend can tell."""
    outcome: list[bool] = []

    def attempt() -> None:
        granted = lock.acquire(timeout=0)
        if granted:
            lock.release()
        outcome.append(granted)

    other = threading.Thread(target=attempt)
    other.start()
    other.join(30)
    return outcome[0]


def seconds_until_lost(lost_at: list[float], since: float) -> float:
    """Wait (at most 5 s) until an ``on_lost`` callback has put its monotonic time in
    ``lost_at``; return the seconds from ``since`` to then."""
    while not lost_at:
        assert time.monotonic() - since < 5, "the holder never learned it lost"
        time.sleep(0.01)
    return lost_at[0] - since


def start_worker(
    target: Any, *args: Any, context: multiprocessing.context.BaseContext = CONTEXT
) -> BaseProcess:
    from djlocks.stress import current_database_names

    names = current_database_names()
    environment = dict(os.environ)
    process = context.Process(
        target=_bootstrap, args=(names, environment, target, args), daemon=True
    )
    process.start()
    return process


@contextlib.contextmanager
def proxied_worker(backend: str, target: Any, *args: Any) -> Iterator[tuple[TcpProxy, BaseProcess]]:
    """``start_worker(target, *args)``, with the store of the backend ``backend`` (its
    Redis, or else the database server) reached through a ``TcpProxy``; yield both, and
    kill the worker at the end."""
    from django.conf import settings
    from django.db import connection

    if backend == "redis":
        url = urlsplit(settings.REDIS_URL)
        proxy = TcpProxy(url.port or 6379, url.hostname or "127.0.0.1")
        variable, value = "REDIS_URL", urlunsplit(url._replace(netloc=f"127.0.0.1:{proxy.port}"))
    else:
        proxy = TcpProxy(int(connection.settings_dict["PORT"]), connection.settings_dict["HOST"])
        variable, value = "DJLOCKS_DB_PORT", str(proxy.port)
    before = os.environ.get(variable)
    os.environ[variable] = value  # what the child reads its settings from
    try:
        worker = start_worker(target, *args)
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before
    try:
        yield proxy, worker
    finally:
        worker.kill()
        worker.join(10)
        proxy.close()


def check_cut_off_bounds(*, lease: bool, ttl: float, other_in: float, told: float) -> None:
    """The oracle of a holder cut off from its store, in seconds since the cut: the other
    side got in (``other_in``) and the holder was told of its loss (``told``). A lease
    holder is told before the other side gets in, within ``ttl`` + 2 s; a session or
    row lock's server ends the holder's session, so the other side gets in within 1 s,
    and the holder is told at its next check (``ttl``/3, plus 0.5 s of slack)."""
    if lease:
        assert told <= other_in, "the cut-off holder still believed when the other got in"
        assert other_in < ttl + 2.0, f"the other side got in after {other_in:.3f} s"
    else:
        assert other_in < 1.0, f"the other side got in after {other_in:.3f} s"
        assert told < ttl / 3 + 0.5, f"the holder was told after {told:.3f} s"


def _bootstrap(
    names: dict[str, str], environment: dict[str, str], target: Any, args: tuple[Any, ...]
) -> None:
    import django

    from djlocks.stress import pin_database_names

    os.environ.clear()
    os.environ.update(environment)  # the forkserver's is the one it started with
    pin_database_names(names)
    django.setup()
    target(*args)


def take_and_release(name: str, times: int) -> None:
    """Take and release ``name`` ``times`` times, then exit at once."""
    from djlocks import db_lock

    for _ in range(times):
        with db_lock(name, timeout=10):
            pass


def take_and_release_until(name: str, stop: Any, grants: Any) -> None:
    """Take and release ``name`` again and again until ``stop`` is set, counting each
    grant in ``grants`` (a shared ``Value``) as it begins."""
    from djlocks import db_lock

    while not stop.is_set():
        with db_lock(name, timeout=30), grants.get_lock():
            grants.value += 1


def hold_then_report(
    name: str, ttl: float, report: Any, hold: float, backend: str = "default"
) -> None:
    """Acquire ``name``, report the fence, hold for ``hold`` seconds (or until killed)."""
    from djlocks import Lock

    lock = Lock(name, ttl=ttl, backend=backend)
    with lock as grant:
        report.put(("held", os.getpid(), grant.fence))
        time.sleep(hold)
    report.put(("released", os.getpid(), grant.fence))


def hold_without_renewal_then_release(
    name: str, ttl: float, report: Any, go: Any, backend: str = "default"
) -> None:
    """Hold without a heartbeat; after ``go`` is set, try to release late."""
    from djlocks import Lock, LockLost

    lock = Lock(name, ttl=ttl, renew=False, backend=backend)
    grant = lock.__enter__()
    report.put(("held", grant.fence))
    go.wait(60)
    try:
        lock.release()
        report.put(("released", grant.fence))
    except LockLost as exc:
        report.put(("lost", str(exc)))


def hold_and_watch(name: str, ttl: float, report: Any, backend: str = "default") -> None:
    """Hold ``name`` with its heartbeat; report the fence, then the monotonic time at
    which the heartbeat says the grant was lost (``on_lost``)."""
    from djlocks import Lock

    lock = Lock(name, ttl=ttl, backend=backend, on_lost=lambda *_: report.put(time.monotonic()))
    grant = lock.acquire_grant()
    assert grant is not None
    report.put(grant.fence)
    time.sleep(120)  # the test ends this process


def try_once(name: str, barrier: Any, report: Any, settled: Any, backend: str = "default") -> None:
    """Line up on ``barrier``, try once, report the outcome, keep a win until
    ``settled`` is set (the parent has every outcome, so no late try meets a freed
    name). The backend is opened before the barrier, so the tries are close."""
    from djlocks import Lock
    from djlocks.backends import backends

    backends[backend]  # import and connect now, not after the barrier
    lock = Lock(name, ttl=30, backend=backend)
    barrier.wait()
    try:
        won = lock.acquire(timeout=0)
    except Exception as exc:
        report.put(("error", repr(exc)))
        return
    report.put(("won" if won else "lost", os.getpid()))
    if won:
        settled.wait(60)
        lock.release()


def wait_in_line(name: str, label: str, report: Any, backend: str = "default") -> None:
    """Block for ``name`` and report the order in which the grant arrived."""
    from djlocks import Lock

    with Lock(name, ttl=30, label=label, backend=backend) as grant:
        report.put((label, grant.fence))
        time.sleep(0.05)


def read_modify_write(
    counter: str, iterations: int, lock_name: str | None, report: Any, backend: str = "row"
) -> None:
    """Add 1 to a ``FencedCounter`` ``iterations`` times, each in its own transaction.

    Read, pause 0-2 ms, write: without a lock that covers the commit, two
    workers read the same value and one update is lost.
    A row lock is taken inside the transaction and ends with its commit; any
    other lock is taken around the transaction, so it is released after the
    commit.
    """
    import random

    from django.db import transaction

    from djlocks import Lock
    from project.demo.models import FencedCounter

    for _ in range(iterations):
        guard = Lock(lock_name, backend=backend) if lock_name else contextlib.nullcontext()
        outer, inner = (
            (transaction.atomic(), guard) if backend == "row" else (guard, transaction.atomic())
        )
        with outer, inner:
            row = FencedCounter.objects.get(name=counter)
            time.sleep(random.uniform(0, 0.002))
            FencedCounter.objects.filter(pk=row.pk).update(value=row.value + 1)
    report.put(("done", os.getpid()))


def obey(name: str, backend: str, ttl: float, orders: Any, report: Any) -> None:
    """Acquire (``timeout=0``) or release ``name`` as ``orders`` say, until "stop";
    report each outcome: "held", "not acquired", "released", or the exception's class."""
    from djlocks import Lock

    lock = Lock(name, ttl=ttl, renew=False, backend=backend)
    grant = None
    while (order := orders.get(timeout=120)) != "stop":
        try:
            if order == "acquire":
                grant = lock.acquire_grant(timeout=0)
                report.put("held" if grant else "not acquired")
            else:
                assert grant is not None
                grant.release()
                report.put("released")
        except Exception as exc:
            report.put(type(exc).__name__)


def grant_storm(name: str, limit: int, backend: str, stop: Any, report: Any) -> None:
    """Take and release ``name`` (a lock, or a semaphore of ``limit``) until ``stop`` is
    set, through a database crash: report each grant as ("granted", pid, fence,
    monotonic time granted, monotonic time released), each failure as ("failed", pid,
    the exception's class name, monotonic time, its message), then ("done", pid)."""
    from django.db import DatabaseError, close_old_connections, transaction

    from djlocks import Lock, Semaphore
    from djlocks.exceptions import BackendUnavailable, LockLost

    handle = (
        Lock(name, backend=backend, timeout=1, ttl=2)
        if limit == 1
        else Semaphore(name, limit=limit, backend=backend, timeout=1, ttl=2)
    )
    while not stop.is_set():
        try:
            with transaction.atomic() if backend == "row" else contextlib.nullcontext():
                grant = handle.acquire_grant()
                if grant is None:
                    continue
                granted = time.monotonic()
                time.sleep(0.002)
                released = time.monotonic()
                grant.release()
            report.put(("granted", os.getpid(), grant.fence, granted, released))
        except (BackendUnavailable, LockLost, DatabaseError) as exc:
            report.put(("failed", os.getpid(), type(exc).__name__, time.monotonic(), str(exc)))
            # What Django does between requests (and Celery between tasks): a connection
            # that failed is closed, so the next query opens a new one. The row backend
            # locks on this connection; the others use their own, reopened by djlocks.
            close_old_connections()
            time.sleep(0.1)
    report.put(("done", os.getpid()))


def campaign(name: str, backend: str, ttl: float, report: Any, again: bool = True) -> None:
    """Campaign for the leadership of ``name``; report ("elected", pid, term) and
    ("deposed", pid, term, reason, monotonic time) as they happen, until killed; once
    deposed, stand by again only if ``again``."""
    from djlocks import leadership

    pid = os.getpid()

    def deposed(term: int, reason: str) -> None:
        report.put(("deposed", pid, term, reason, time.monotonic()))
        if not again:
            candidate.stop()

    candidate = leadership(
        name,
        backend=backend,
        ttl=ttl,
        on_elected=lambda term: report.put(("elected", pid, term)),
        on_deposed=deposed,
    ).start()
    time.sleep(120)  # the test ends this process


def read_then_report(name: str, backend: str, ttl: float, report: Any) -> None:
    """Enter ``name`` (a ``db_rwlock``) as a reader, report its fence, read until killed."""
    from djlocks import db_rwlock

    with db_rwlock(name, max_readers=4, backend=backend, ttl=ttl).read() as grant:
        report.put(grant.fence)
        time.sleep(120)  # the test ends this process


def hold_together_until_lost(kind: str, name: str, backend: str, ttl: float, report: Any) -> None:
    """Take what is made of several grants: ``kind`` ``"writer"`` (the writer of the
    ``db_rwlock`` ``name``) or ``"set"`` (``db_locks`` of ``name:a``, ``name:b``,
    ``name:c``); report ("held", pid); at its first grant's loss report ("lost", reason,
    monotonic time); hold until killed."""
    from djlocks import db_locks, db_rwlock

    def lost(grant: Any, reason: str) -> None:
        report.put(("lost", reason, time.monotonic()))

    options = {"backend": backend, "ttl": ttl, "on_lost": lost}
    if kind == "writer":
        held = db_rwlock(name, max_readers=4, **options).write()
    else:
        held = db_locks([f"{name}:a", f"{name}:b", f"{name}:c"], **options)
    with held:
        report.put(("held", os.getpid()))
        time.sleep(120)  # the test ends this process
