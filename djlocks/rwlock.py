"""Readers and writers: ``db_rwlock(name)``, many readers at once or one writer.

Built from two names of one backend, each waited for in the store like any lock
(no polling beyond the backend's own):

* the **gate**, the lock ``djlocks:rw:<name>:gate``: a reader holds it only for
  the moment it takes to enter, a writer for the whole write;
* the **readers' slots**, the semaphore ``djlocks:rw:<name>:readers`` of
  ``max_readers`` slots: a reader holds one while it reads, a writer all of them.

A reader takes the gate, then a slot, and gives the gate back. A writer takes
the gate and keeps it, so no new reader enters, then takes every slot one by one
as the readers inside leave, then writes. Writers are preferred: once a writer
holds the gate, readers that arrive wait until it is done, so a stream of readers
never starves a writer; and a writer waiting for the gate is next in line on the
backends that serve waiters in order (``capabilities.fifo``). Two writers never
deadlock: only the gate's holder takes more than one slot.

Each grant has its fence: a reader's is its slot's, a writer's the gate's, which
rises with every writer, so what a writer writes can be fenced
(``djlocks.fencing``).
"""

from __future__ import annotations

import time
from typing import Any

from djlocks.arguments import Seconds, normalize_timeout, validate_limit, validate_name
from djlocks.core import _USE_SPEC, Lock, Semaphore
from djlocks.exceptions import NotAcquired, NotHeld
from djlocks.grant import Grant
from djlocks.many import end_all

#: The names a reader-writer lock is made of: ``RW_PREFIX + name + GATE`` and ``... + READERS``.
RW_PREFIX, GATE, READERS = "djlocks:rw:", ":gate", ":readers"
#: Readers at once by default; a writer takes this many slots.
MAX_READERS = 16


def rw_parts(lock_name: str) -> tuple[str, str] | None:
    """``(name, "gate" | "readers")`` if ``lock_name`` is a part of a reader-writer lock."""
    if not lock_name.startswith(RW_PREFIX):
        return None
    for suffix in (GATE, READERS):
        if lock_name.endswith(suffix):
            return lock_name[len(RW_PREFIX) : -len(suffix)], suffix[1:]
    return None


class RWLock:
    """Many readers at once, or one writer, of ``name`` (see the module).

    Arguments: ``name`` (``str``, at most 232 characters); ``max_readers`` (``int``,
    readers at once, default 16: more wait, and a writer takes that many slots, so
    keep it near the readers you expect); ``timeout`` (seconds to wait, ``None``:
    forever, ``0``: try once); and ``ttl``, ``backend``, ``label``, ``renew`` as for
    ``Lock``. Every process must pass the same ``max_readers`` (``AlreadyHeld``
    otherwise, as for a semaphore's limit). The row backend cannot hold one
    (``ValueError`` at acquire: see ``refuse_unable_backend``).

    ``with rw.read() as grant:`` and ``with rw.write() as grant:`` raise
    ``NotAcquired`` after ``timeout``; ``rw.read().acquire_grant()`` returns ``None``
    instead. Raises ``ValueError``/``TypeError`` for bad arguments.
    """

    def __init__(
        self,
        name: str,
        *,
        max_readers: int = MAX_READERS,
        timeout: Seconds | None = None,
        **options: Any,
    ) -> None:
        self.name = validate_name(name)
        validate_name(RW_PREFIX + name + READERS)  # short enough for its parts' names
        self.max_readers = validate_limit(max_readers, "max_readers")
        self.timeout = normalize_timeout(timeout)
        self._gate = Lock(RW_PREFIX + name + GATE, **options)
        self._slots = Semaphore(RW_PREFIX + name + READERS, limit=self.max_readers, **options)

    def __repr__(self) -> str:
        return f"db_rwlock({self.name!r}, max_readers={self.max_readers})"

    def refuse_unable_backend(self) -> None:
        """``ValueError`` if the backend cannot hold the parts: it must take semaphores
        and give back one of a thread's grants while keeping the others (not the row
        backend, whose grants all end with the caller's transaction)."""
        capabilities = self._gate.backend.capabilities
        if capabilities.in_caller_transaction or not capabilities.semaphores:
            raise ValueError(
                f"The backend {self._gate.backend_alias!r} cannot hold a reader-writer lock: "
                f"a reader gives back the gate while it keeps its slot, and this backend's "
                f"grants end together, with the caller's transaction. Use the lease "
                f"backend, a session backend or Redis."
            )

    def read(self, timeout: Any = _USE_SPEC) -> Side:
        """One reader: a context manager giving its ``Grant`` (see the class)."""
        return Side(self, writer=False, timeout=timeout)

    def write(self, timeout: Any = _USE_SPEC) -> Side:
        """The writer: a context manager giving its ``Grant`` (see the class)."""
        return Side(self, writer=True, timeout=timeout)


class Side:
    """A reader or the writer of an ``RWLock``: ``with``, or ``acquire_grant()`` and
    ``release()`` from the same object."""

    def __init__(self, lock: RWLock, *, writer: bool, timeout: Any) -> None:
        self.lock = lock
        self.writer = writer
        self.timeout = lock.timeout if timeout is _USE_SPEC else normalize_timeout(timeout)
        self._held: list[Grant] = []

    def __repr__(self) -> str:
        return f"<{'writer' if self.writer else 'reader'} of {self.lock!r}>"

    def acquire_grant(self) -> Grant | None:
        """Enter as a reader or the writer within ``timeout`` seconds; return the grant
        (the slot's for a reader, the gate's for the writer), or ``None`` after the
        time-out with nothing left held. ``RuntimeError`` if this side already holds."""
        if self._held:
            raise RuntimeError(f"{self!r} already holds; release() it first.")
        self.lock.refuse_unable_backend()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        taken: list[Grant] = []
        try:
            gate = self.lock._gate.acquire_grant(timeout=_left(deadline))
            if gate is None:
                return None
            taken.append(gate)
            for _ in range(self.lock.max_readers if self.writer else 1):
                slot = self.lock._slots.acquire_grant(timeout=_left(deadline))
                if slot is None:
                    end_all(taken)
                    return None
                taken.append(slot)
            if not self.writer:  # the reader is in: let the next one through the gate
                taken.pop(0)
                gate.release()
        except BaseException as exc:
            end_all(taken, (type(exc), exc, exc.__traceback__))
            raise
        self._held = taken
        return taken[0]

    def release(self) -> None:
        """Leave: give back every name held, the last taken first; ``LockLost`` (once
        all are given back) if any was lost meanwhile; ``NotHeld`` if none is held."""
        held, self._held = self._held, []
        if not held:
            raise NotHeld(f"{self!r} holds nothing.")
        end_all(held)

    def __enter__(self) -> Grant:
        grant = self.acquire_grant()
        if grant is None:
            role = "writer" if self.writer else "reader"
            raise NotAcquired(
                f"{self.lock.name!r} was not entered as a {role} within {self.timeout} s."
            )
        return grant

    def __exit__(self, *exc_info: Any) -> None:
        held, self._held = self._held, []
        end_all(held, exc_info)


def db_rwlock(name: str, **options: Any) -> RWLock:
    """Many readers or one writer of ``name``: ``RWLock(name, **options)``."""
    return RWLock(name, **options)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
