"""Turns at a SQLite lease store: file locks beside the database, taken around each operation.

SQLite's write lock is not fair. A connection that finds it taken sleeps in
SQLite's busy handler (1, 2, 5, 10, 15, 20, 25 ms, and longer later) before it
tries again, and the process that just released a lease can commit its next
claim in one of those gaps, and the next, and the next: a process on its way
into the queue (its first claim or its place not yet written) was overtaken
again and again, with 8 processes taking one lease lock.

So on SQLite each lease operation of this host first takes its turn, with two
``flock(2)`` locks on files beside the database, named after it (as SQLite's own
``-wal`` and ``-shm`` are): ``-djlocks-next``, then ``-djlocks-turn``, and it
lets go of ``-next`` as soon as it has ``-turn``. A process that finds them taken
sleeps in the kernel, which wakes it as soon as they are unlocked. The one
waiting for ``-turn`` holds ``-next``, so the process whose turn just ended
cannot take the next one before it. (The processes waiting for ``-next`` are
all woken at once, and the scheduler picks one: the turns are not first come,
first served, but a process cannot take two turns in a row past a waiter.)
Fairness is all this adds: mutual exclusion stays with the lease rows.

Operations take no turns where the files cannot be opened or locked (a
directory the process may not write to, a file system without ``flock``: logged
once), on a system without ``flock`` (Windows), for an in-memory database
(nothing beside it, and no other process), and where gevent or eventlet patched
``threading``: there a process's greenlets share one thread, and one waiting in
the kernel would stop the greenlet whose turn it waits for.

An ``flock`` belongs to an open file, which a thread shares with its process's
other threads and a forked child with its parent: each thread opens the files
once per process, and an operation run inside another takes no second turn. A
forked child closes every descriptor it inherited, of any of the parent's
threads, as it starts, so that a parent killed during a turn does not leave it
held.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import weakref
from collections.abc import Iterator

from djlocks.backends.sqlite_checks import database_file
from djlocks.forksafe import fork_safe_lock
from djlocks.green import green_threads

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

acquire_log = logging.getLogger("djlocks.acquire")

#: What the names of the files locked add to the database file's: the one held to
#: be next, and the one held for the turn.
NEXT, TURN = "-djlocks-next", "-djlocks-turn"

#: The gate of each database file in this process, by its path (``write_gate``).
_GATES: dict[str | None, WriteGate] = {}
_GATES_GUARD = fork_safe_lock()
#: What ``flock`` fails with on a file system that cannot lock: no turns there.
CANNOT_LOCK = frozenset({errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


def write_gate(database: str) -> WriteGate:
    """This process's one gate of the SQLite database ``database`` (a ``NAME``). One per
    file: a thread whose turn is held through one gate would wait for itself at
    another (each has its own descriptors), were two made, by two backends on one file
    or by two threads that asked for a backend's first at once."""
    path = database_file(database)
    with _GATES_GUARD:
        gate = _GATES.get(path)
        if gate is None:
            gate = _GATES[path] = WriteGate(path)
        return gate


class WriteGate:
    """The turns of this host's lease operations on the SQLite database file ``database``
    (``None``: in memory, no turns); make it with ``write_gate``."""

    def __init__(self, database: str | None) -> None:
        self.database = database
        self._threads = threading.local()
        self._warned = False

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for this thread's turn (no time limit: an operation holds it for one
        transaction) and hold it for the block; within the block, a nested ``turn``
        is already held."""
        threads, entered = self._threads, os.getpid()
        if getattr(threads, "pid", None) != entered:  # first use, or a forked child
            threads.pid, threads.files, threads.depth = entered, self._open(), 0
        files = None if threads.depth else threads.files
        threads.depth += 1
        try:
            if files is not None and not self._taken(files):
                files = threads.files = None  # this file system cannot lock: no turns
            yield
        finally:
            # A forked child leaving a turn it inherited: the hook let go of it.
            if getattr(threads, "pid", None) == entered:
                threads.depth -= 1
                if files is not None and not files.closed:
                    fcntl.flock(files.turn, fcntl.LOCK_UN)

    def _taken(self, files: _Descriptors) -> bool:
        """Take the turn (``-next``, then ``-turn``, then ``-next`` let go); False, with
        nothing held, if the file system cannot lock (logged once)."""
        try:
            try:
                fcntl.flock(files.next_in_line, fcntl.LOCK_EX)
                fcntl.flock(files.turn, fcntl.LOCK_EX)
            finally:  # also for an exception raised as the first flock returns
                fcntl.flock(files.next_in_line, fcntl.LOCK_UN)
        except OSError as exc:
            if exc.errno not in CANNOT_LOCK:
                raise  # a time-out raised by a signal's handler, say: not ours to keep
            self._warn(exc)
            return False
        return True

    def forget_inherited(self) -> None:
        """Let go of this (forked) process's thread's gate state: its descriptors were
        closed (``_forget_inherited_turns``), and a turn it runs inside is not its own."""
        self._threads.__dict__.clear()

    def _open(self) -> _Descriptors | None:
        """This thread's descriptors of the two files, each made if it was missing;
        ``None`` where there are none to lock (see the module; logged once)."""
        if fcntl is None or self.database is None or green_threads() is not None:
            return None
        opened: list[int] = []
        try:
            for suffix in (NEXT, TURN):
                # Read-only is enough to lock; O_CREAT makes it for the first process.
                opened.append(os.open(self.database + suffix, os.O_RDONLY | os.O_CREAT, 0o666))
        except OSError as exc:
            for descriptor in opened:
                os.close(descriptor)
            self._warn(f"{exc}; let the process write in the database's directory")
            return None
        return _Descriptors(*opened)

    def _warn(self, why: object) -> None:
        if not self._warned:
            self._warned = True
            acquire_log.warning(
                "lease operations on the SQLite database %s take no turns (%s), so a "
                "newcomer may be overtaken by a process that releases and claims again",
                self.database,
                why,
            )


def _forget_inherited_turns() -> None:
    """In a forked child: close every descriptor of the gates' files it inherited, the
    turns other threads of the parent held included (their frames live on, never to
    run), then forget the forking thread's state."""
    for files in list(_OPEN):
        files.close()
    for gate in list(_GATES.values()):
        gate.forget_inherited()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_turns)


class _Descriptors:
    """A thread's open descriptors of the two files, closed when they are forgotten (its
    thread ended, or a forked child let go of what it inherited): closing a child's
    copies leaves its parent's locks."""

    __slots__ = ("__weakref__", "closed", "next_in_line", "turn")

    def __init__(self, next_in_line: int, turn: int) -> None:
        self.next_in_line, self.turn = next_in_line, turn
        self.closed = False
        _OPEN.add(self)

    def close(self) -> None:
        """Close both, once: their numbers may then be given to other files."""
        if not self.closed:
            self.closed = True
            for descriptor in (self.next_in_line, self.turn):
                with contextlib.suppress(OSError):
                    os.close(descriptor)

    def __del__(self) -> None:
        self.close()


#: Every thread's open descriptors in this process, for a forked child to close.
_OPEN: weakref.WeakSet[_Descriptors] = weakref.WeakSet()
