"""Turns at a SQLite lease store: file locks beside the database, taken around each operation.

SQLite's write lock is not fair. A connection that finds it taken sleeps in
SQLite's busy handler (1, 2, 5, 10, 15, 20, 25 ms and on) before it tries again,
and the process that just released a lease can commit its next claim in one of
those gaps, and the next, and the next: a process on its way into the queue
(its first claim or its place not yet written) was overtaken again and again
for up to 25 ms at a time, with 8 processes taking one lease lock.

So on SQLite each lease operation of this host first takes its turn, with two
``flock(2)`` locks on files beside the database, named after it (as SQLite's own
``-wal`` and ``-shm`` are): ``-djlocks-next``, then ``-djlocks-turn``, and it
lets go of ``-next`` as soon as it has ``-turn``. A process that finds them taken
sleeps in the kernel, which wakes it as soon as they are unlocked. The one
waiting for ``-turn`` holds ``-next``, so the process whose turn just ended cannot
take the next one before it: a turn passes to a waiter whenever there is one.
Fairness is all this adds: mutual exclusion stays with the lease rows. A
process that cannot open the files (a directory it may not write to), or a
system without ``flock`` (Windows), runs its operations without turns, as
before, after one warning.

An ``flock`` belongs to an open file, which a thread shares with its process's
other threads and a forked child with its parent: each thread opens the files
once per process, and an operation run inside another takes no second turn.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

acquire_log = logging.getLogger("djlocks.acquire")

#: What the names of the files locked add to the database file's: the one held to
#: be next, and the one held for the turn.
NEXT, TURN = "-djlocks-next", "-djlocks-turn"


#: The gate of each database file in this process, by its real path (``write_gate``).
_GATES: dict[str, WriteGate] = {}
_GATES_GUARD = threading.Lock()


def write_gate(database: str) -> WriteGate:
    """This process's one gate of the SQLite database file ``database``. One per file:
    a thread whose turn is held through one gate would wait for itself at another
    (each has its own descriptors), were two made, by two backends on one file or by
    two threads that asked for a backend's first at once."""
    path = os.path.realpath(database)
    with _GATES_GUARD:
        gate = _GATES.get(path)
        if gate is None:
            gate = _GATES[path] = WriteGate(path)
        return gate


class WriteGate:
    """The turns of this host's lease operations on the SQLite database file ``database``
    (make it with ``write_gate``)."""

    def __init__(self, database: str) -> None:
        self.database = os.path.realpath(database)
        self._threads = threading.local()
        self._warned = False

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for this thread's turn (no time limit: an operation holds it for one
        transaction) and hold it for the block; within the block, a nested ``turn``
        is already held."""
        threads = self._threads
        if getattr(threads, "pid", None) != os.getpid():  # first use, or a forked child
            threads.pid, threads.files, threads.depth = os.getpid(), self._open(), 0
        files = None if threads.depth else threads.files
        threads.depth += 1
        try:
            if files is not None:
                fcntl.flock(files.next_in_line, fcntl.LOCK_EX)
                try:
                    fcntl.flock(files.turn, fcntl.LOCK_EX)
                finally:
                    fcntl.flock(files.next_in_line, fcntl.LOCK_UN)
            yield
        finally:
            threads.depth -= 1
            if files is not None:
                fcntl.flock(files.turn, fcntl.LOCK_UN)

    def _open(self) -> _Descriptors | None:
        """This thread's descriptors of the two files, each made if it was missing;
        ``None`` where they cannot be opened (logged once)."""
        if fcntl is None:
            return None
        opened: list[int] = []
        try:
            for suffix in (NEXT, TURN):
                # Read-only is enough to lock; O_CREAT makes it for the first process.
                opened.append(os.open(self.database + suffix, os.O_RDONLY | os.O_CREAT, 0o666))
        except OSError as exc:
            for descriptor in opened:
                os.close(descriptor)
            if not self._warned:
                self._warned = True
                acquire_log.warning(
                    "cannot open %s%s (%s): lease operations on this SQLite database take "
                    "no turns, so a newcomer may be overtaken by a process that releases "
                    "and claims again; let the process write in the database's directory",
                    self.database,
                    TURN,
                    exc,
                )
            return None
        return _Descriptors(*opened)


class _Descriptors:
    """A thread's open descriptors of the two files, closed when they are forgotten (its
    thread ended, or a forked child opened its own): closing a child's copies leaves
    its parent's locks."""

    __slots__ = ("next_in_line", "turn")

    def __init__(self, next_in_line: int, turn: int) -> None:
        self.next_in_line, self.turn = next_in_line, turn

    def __del__(self) -> None:
        for descriptor in (self.next_in_line, self.turn):
            with contextlib.suppress(OSError):
                os.close(descriptor)
