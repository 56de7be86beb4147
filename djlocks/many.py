"""Several names taken together, every one or none: ``db_locks``.

Two callers that each want a set of names, and take them one by one, can wait
for each other forever if they take them in different orders (each holds one
name the other waits for). ``Locks`` takes its names in one global order (the
names' text, by code point), the same in every process, so no two callers wait
in a cycle: whoever gets the first contended name first goes on, the other
queues behind it. One time-out covers the whole set. On a time-out, an error or
a cancellation, every name taken so far is released (the last taken first)
before ``acquire`` returns or raises: a set is never left half held. Each name
gets a ``Grant`` of its own, with its own fence.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from djlocks.arguments import normalize_timeout, validate_name
from djlocks.core import _USE_SPEC, Lock, _holder_key, pop_held
from djlocks.exceptions import LockLost, NotAcquired
from djlocks.forksafe import fork_safe_lock
from djlocks.grant import ExcInfo, Grant


class Locks:
    """Locks on several names of one backend, taken together (see the module).

    Arguments: ``names``, the names (an iterable of ``str``, each as for ``Lock``;
    duplicates count once, at least one); ``timeout``, seconds for the whole set
    (``None``: forever, ``0``: try each name once); and every other argument of
    ``Lock`` (``ttl``, ``backend``, ``label``, ``renew``, ``max_hold``,
    ``on_lost``, ``cooldown``), which applies to each name.

    ``with db_locks(["a", "b"], timeout=5) as grants:`` gives a mapping of each
    name to its ``Grant``; ``NotAcquired`` if the set was not granted in time.
    Raises ``ValueError``/``TypeError`` for bad arguments at construction.
    """

    def __init__(self, names: Iterable[str], *, timeout: Any = None, **options: Any) -> None:
        if isinstance(names, str):
            raise TypeError(f"db_locks takes a list of names, not one name ({names!r}).")
        unique = sorted({validate_name(name) for name in names})
        if not unique:
            raise ValueError("db_locks needs at least one name.")
        self.timeout = normalize_timeout(timeout)
        self._locks = [Lock(name, **options) for name in unique]
        self._held: dict[tuple[int, int], list[list[Grant]]] = {}
        self._held_guard = fork_safe_lock()

    @property
    def names(self) -> list[str]:
        """The names, in the order they are taken."""
        return [lock.name for lock in self._locks]

    def __repr__(self) -> str:
        return f"db_locks({self.names!r})"

    def acquire_grants(self, timeout: Any = _USE_SPEC) -> dict[str, Grant] | None:
        """Take every name, in order, within ``timeout`` seconds in all (default: the
        spec's); return each name's ``Grant``, or ``None`` on time-out, having
        released what was taken. Raises what ``Lock.acquire_grant`` raises, after
        releasing what was taken."""
        wait = self.timeout if timeout is _USE_SPEC else normalize_timeout(timeout)
        deadline = None if wait is None else time.monotonic() + wait
        taken: list[Grant] = []
        try:
            for lock in self._locks:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                grant = lock.acquire_grant(timeout=left)
                if grant is None:
                    end_all(taken)
                    return None
                taken.append(grant)
        except BaseException as exc:
            end_all(taken, (type(exc), exc, exc.__traceback__))
            raise
        return {grant.name: grant for grant in taken}

    def acquire(self, timeout: Any = _USE_SPEC) -> bool:
        """Take every name (see ``acquire_grants``); ``True`` if granted, ``False`` on
        time-out. ``release()`` from the same thread gives the set back."""
        grants = self.acquire_grants(timeout)
        if grants is None:
            return False
        with self._held_guard:
            self._held.setdefault(_holder_key(), []).append(list(grants.values()))
        return True

    def release(self) -> None:
        """Release the set this thread (or task) took last, the last name taken first.

        Every name is released even if one of them had been lost; ``LockLost`` (the
        first loss) is raised afterwards. ``NotHeld`` if this thread holds no set.
        """
        end_all(self._pop_current())

    def __enter__(self) -> Mapping[str, Grant]:
        grants = self.acquire_grants()
        if grants is None:
            raise NotAcquired(f"{self.names!r} were not all acquired within {self.timeout} s.")
        with self._held_guard:
            self._held.setdefault(_holder_key(), []).append(list(grants.values()))
        return grants

    def __exit__(self, *exc_info: Any) -> None:
        end_all(self._pop_current(), exc_info)

    def _pop_current(self) -> list[Grant]:
        return pop_held(self._held, self._held_guard, self)


def db_locks(names: Iterable[str], **options: Any) -> Locks:
    """Several names taken together, every one or none: ``Locks(names, **options)``."""
    return Locks(names, **options)


def end_all(grants: list[Grant], exc_info: ExcInfo = (None, None, None)) -> None:
    """End ``grants`` (each as its ``with`` block would, given ``exc_info``), the last
    taken first; raise the first ``LockLost`` once all ended."""
    lost: LockLost | None = None
    for grant in reversed(grants):
        grant.spec.forget(grant)
        try:
            grant.end(exc_info)
        except LockLost as exc:
            lost = lost or exc
    if lost is not None:
        raise lost
