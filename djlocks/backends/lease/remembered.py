"""A bounded set of what a lease store remembers of its own recent operations."""

from __future__ import annotations

from djlocks.forksafe import fork_safe_lock


class Remembered:
    """The latest ``most`` strings added, in order, shared by the process's threads: an
    older one is forgotten as a newer one comes in."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._members: dict[str, None] = {}
        self._guard = fork_safe_lock()

    def add(self, member: str) -> None:
        with self._guard:
            self._members.pop(member, None)  # the newest again
            self._members[member] = None
            if len(self._members) > self._most:
                del self._members[next(iter(self._members))]

    def forget(self, member: str) -> bool:
        """Forget ``member``; whether it was remembered."""
        with self._guard:
            return self._members.pop(member, False) is None

    def __contains__(self, member: object) -> bool:
        return member in self._members
