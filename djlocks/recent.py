"""A set whose members drop out a fixed number of seconds after they were last added."""

from __future__ import annotations

import time
from collections.abc import Hashable

from djlocks.forksafe import fork_safe_lock

#: Seconds after a try found a lock taken during which this process's acquires of it
#: skip the try and wait at once (the session and Redis backends): a lock that stays
#: contended costs one failed try per second and process, not one per acquire.
CONTENDED_FOR = 1.0


class Recent:
    """Members (any hashable) added in the last ``seconds`` seconds, by the monotonic
    clock; thread-safe, and cheap to ask: one dictionary look-up, with no lock."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._at: dict[Hashable, float] = {}
        self._guard = fork_safe_lock()
        self._pruned_at_size = 1024

    def __contains__(self, member: Hashable) -> bool:
        at = self._at.get(member)  # one lookup, atomic: no guard needed to read
        return at is not None and time.monotonic() - at < self._seconds

    def discard(self, member: Hashable) -> None:
        """Forget ``member`` at once."""
        with self._guard:
            self._at.pop(member, None)

    def add(self, member: Hashable) -> None:
        now = time.monotonic()
        with self._guard:
            self._at[member] = now
            if len(self._at) >= self._pruned_at_size:  # forget what is stale anyway
                self._at = {key: at for key, at in self._at.items() if now - at < self._seconds}
                self._pruned_at_size = max(1024, 2 * len(self._at))
