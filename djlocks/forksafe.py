"""Locks that a forked child finds unlocked.

``fork()`` copies a lock in the state it is in. A lock that another thread of
the parent held (or was taking) at that moment (a listener thread checking its watch list, the
heartbeat renewing, a thread opening a connection) stays locked forever in the
child, where that thread does not exist: the child's first lock operation
would hang. djlocks' long-lived guards (per process, per backend, per spec)
are therefore ``fork_safe_lock()``: a forked child remakes every one of them,
unlocked, before it runs any code (``os.register_at_fork``). What
each guard protects is reset by its owner when it sees a new process id.
"""

from __future__ import annotations

import os
import threading
import weakref


def fork_safe_lock() -> threading.Lock:
    """A ``threading.Lock`` that a forked child finds unlocked."""
    lock = threading.Lock()
    _every_lock.add(lock)
    return lock


_every_lock: weakref.WeakSet[threading.Lock] = weakref.WeakSet()


def _unlock_all_in_child() -> None:
    """Runs in a forked child, where the only thread is the one that called fork():
    every guard is made anew, unlocked (``_at_fork_reinit``, as the standard library
    remakes its own locks at a fork). Releasing only those that say they are locked
    is not enough: CPython takes the lock beneath before it marks a lock locked, and
    waits for the GIL between the two, so a fork while another thread takes one
    leaves a lock that says it is free and that no acquire ever gets."""
    for lock in list(_every_lock):
        lock._at_fork_reinit()  # type: ignore[attr-defined]  # CPython's since 3.9


os.register_at_fork(after_in_child=_unlock_all_in_child)
