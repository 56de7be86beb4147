"""The names a process wrote to its store lately, and when to write them again.

A process creates a name's rows (or records the name) once, not at every grant.
``djlocks sweep`` may later remove a name that stayed idle
(``LockBackend.sweep(idle_names=...)``), so a process forgets what it wrote
after ``RECHECK`` seconds and writes it again: a name it uses keeps its rows.
The sweep refuses idle times shorter than ``SHORTEST_IDLE``, so a name that a
process has just written (and then took, or waits for) is never removed under it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

from djlocks.forksafe import fork_safe_lock

#: Seconds a process trusts that a name it wrote is still in the store.
RECHECK = 60.0
#: The shortest idle time, in seconds, after which a sweep may remove a name.
SHORTEST_IDLE = 2 * RECHECK


class WrittenNames:
    """Names (any hashable: a name and limit, a key) written to the store in the last
    ``RECHECK`` seconds; thread-safe."""

    def __init__(self) -> None:
        self._at: dict[Hashable, float] = {}
        self._guard = fork_safe_lock()
        self._pruned_at_size = 1024

    def __contains__(self, name: Hashable) -> bool:
        at = self._at.get(name)  # one lookup, atomic: no guard needed to read
        return at is not None and time.monotonic() - at < RECHECK

    def discard(self, name: Hashable) -> None:
        """Forget ``name``: the store no longer has it."""
        with self._guard:
            self._at.pop(name, None)

    def add(self, name: Hashable) -> None:
        now = time.monotonic()
        with self._guard:
            self._at[name] = now
            if len(self._at) >= self._pruned_at_size:  # forget what is stale anyway
                self._at = {key: at for key, at in self._at.items() if now - at < RECHECK}
                self._pruned_at_size = max(1024, 2 * len(self._at))
