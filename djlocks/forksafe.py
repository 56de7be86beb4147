"""Locks that a forked child finds unlocked.

``fork()`` copies a lock in the state it is in. A lock that another thread of
the parent held at that moment (a listener thread checking its watch list, the
heartbeat renewing, a thread opening a connection) stays locked forever in the
child, where that thread does not exist: the child's first lock operation
would hang. djlocks' long-lived guards (per process, per backend, per spec)
are therefore ``ForkSafeLock``: a forked child replaces every one of them with
a new, unlocked lock before it runs any code (``os.register_at_fork``). What
each guard protects is reset by its owner when it sees a new process id.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType


class ForkSafeLock:
    """A ``threading.Lock`` (the same methods) that is unlocked in a forked child."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _every_lock.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._lock.release()


_every_lock: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _unlock_all_in_child() -> None:
    """Runs in a forked child, where the only thread is the one that called fork()."""
    for lock in list(_every_lock):
        lock._lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_all_in_child)
