"""Deadlocks between session locks, found by djlocks since the server cannot see them.

Each session grant has a server session of its own (so that two handles of one
thread exclude each other), so when thread X holds A and waits for B while
thread Y holds B and waits for A, the server sees four unrelated sessions and
no cycle: MySQL's ``GET_LOCK`` deadlock detection (3058) and PostgreSQL's
(40P01) only see cycles between sessions. djlocks joins the sessions to their
owners (host, pid, thread) itself:

* a waiting session's owner is in its wait's description (``describe``): the
  query comment on MySQL, ``application_name`` on PostgreSQL;
* a holding session's owner is in its own description on PostgreSQL (the
  ``application_name`` its grant set), else in djlocks' holder row for its
  connection.

A wait that has lasted ``CHECK_AFTER`` seconds (PostgreSQL's own
``deadlock_timeout`` is 1 s) is checked once, from another session, while it
goes on waiting in the server. If its owner is on a cycle of owners, each
waiting for a session another one holds, the waiter that began waiting last
is the victim (of two that began at the same moment, the one with the higher
connection id): its session is killed and its acquire raises ``LockDeadlock``.
Every other waiter on the cycle began earlier, so the victim is always the
last to check, and finds the cycle complete: there is one victim per cycle.
Semaphore gates and slots are not followed (a gate's holder has no holder row).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

#: Seconds a wait lasts before it is checked for a deadlock.
CHECK_AFTER = 1.0

#: Host, pid, and the thread id (``threading.get_native_id``) or, for an async acquire,
#: the task's (``identity.task_identity``): a memory address, never a thread's id.
Owner = tuple[str, int, int]
_TID = re.compile(r"\((?:tid|task) (\d+)\)$")


@functools.lru_cache(maxsize=1024)  # a few threads' descriptions, asked at every wait
def owner_of(host: str, pid: int, thread: str) -> Owner | None:
    """The owner of a holder row (its ``thread`` ends in ``(tid N)`` or ``(task N)``, see
    ``Identity``)."""
    found = _TID.search(thread)
    return None if found is None else (host, pid, int(found.group(1)))


@dataclass(frozen=True)
class Wait:
    """A session that waits for a key, and the session that holds that key."""

    waiter: int  # server connection id
    owner: Owner | None  # whose wait it is, from its description
    since: datetime  # when the wait began, by the server's clock
    key: int | str  # the server's key
    holder: int  # the connection id holding the key
    #: Whose the holding session is, where the server shows it (PostgreSQL's
    #: ``application_name``, set in the granting statement); else djlocks' holder rows say.
    holder_owner: Owner | None = None


#: The owner of each (holding connection id, key), from djlocks' holder rows.
Holders = dict[tuple[int, int | str], Owner]


def is_victim(me: int, waits: Iterable[Wait], owners: Holders) -> bool:
    """Whether the waiting session ``me`` is on a cycle and began waiting last on it."""
    by_waiter = {wait.waiter: wait for wait in waits}
    mine = by_waiter.get(me)
    if mine is None or mine.owner is None:
        return False
    waits_of: dict[Owner, list[Wait]] = {}
    for wait in by_waiter.values():
        if wait.owner is not None:
            waits_of.setdefault(wait.owner, []).append(wait)
    cycle = _cycle_through(mine.owner, waits_of, owners)
    # Two waits that began in the same microsecond: the higher connection id is last.
    began = (mine.since, mine.waiter)
    return cycle is not None and all((wait.since, wait.waiter) <= began for wait in cycle)


def _cycle_through(
    start: Owner, waits_of: dict[Owner, list[Wait]], owners: Holders
) -> list[Wait] | None:
    """The waits of a cycle of owners through ``start`` (depth first), or ``None``."""
    path: list[Wait] = []
    seen: set[Owner] = set()

    def walk(owner: Owner) -> bool:
        for wait in waits_of.get(owner, []):
            blocker = owners.get((wait.holder, wait.key))
            if blocker is None or (blocker != start and blocker in seen):
                continue
            path.append(wait)
            if blocker == start:
                return True
            seen.add(blocker)
            if walk(blocker):
                return True
            path.pop()
        return False

    return path if walk(start) else None


def watched(check: Callable[[], bool], kill: Callable[[], None]) -> _Watch:
    """Around a wait in the server (``with watched(check, kill) as watch:``): after
    ``CHECK_AFTER`` seconds, if ``check()`` says this wait is a deadlock's victim,
    ``kill()`` its session. The watch's ``victim`` is then true; the wait then fails,
    and the caller raises ``LockDeadlock``.

    The checks of every wait of the process run on one thread (``_Watcher``), so a
    wait that ends within ``CHECK_AFTER`` costs no thread of its own."""
    return _Watch(check, kill)


class _Watch:
    """One wait's deadlock check, a context manager around the wait; leaving it
    returns once no check of it runs or will."""

    def __init__(self, check: Callable[[], bool], kill: Callable[[], None]) -> None:
        self.due = time.monotonic() + CHECK_AFTER
        self.victim = False  # set before the kill
        self._check, self._kill = check, kill
        self._guard = threading.Lock()  # held while the check runs
        self.ended = False

    def __enter__(self) -> _Watch:
        _watcher.add(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.end()

    def run(self) -> None:
        with self._guard:
            if self.ended:
                return
            try:
                if self._check():
                    self.victim = True
                    self._kill()
            except Exception:  # the check is best effort: the wait goes on, as without it
                return

    def end(self) -> None:
        with self._guard:
            self.ended = True


class _Watcher:
    """The process's thread that runs each wait's check when it falls due."""

    def __init__(self) -> None:
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._changed = threading.Condition()
        self._due: list[tuple[float, int, _Watch]] = []
        self._count = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, watch: _Watch) -> None:
        with self._changed:
            heapq.heappush(self._due, (watch.due, next(self._count), watch))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="djlocks-deadlock-watch", daemon=True
                )
                self._thread.start()
            if self._due[0][2] is watch:  # due before every other: the thread must re-plan
                self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    while self._due and self._due[0][2].ended:  # most waits end in time
                        heapq.heappop(self._due)
                    if self._due and self._due[0][0] <= time.monotonic():
                        break
                    self._changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, watch = heapq.heappop(self._due)
            watch.run()


_watcher = _Watcher()
