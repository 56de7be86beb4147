"""The exception tree: every lock-state failure is a :class:`LockError`."""

from __future__ import annotations


class LockError(Exception):
    """Base class of every error djlocks raises about a lock's state."""


class NotAcquired(LockError):
    """The lock or a semaphore slot was not granted before the timeout ran out."""


class NotHeld(LockError):
    """``release()`` was called through a handle that holds nothing."""


class AlreadyHeld(LockError):
    """The name is in use with different parameters (for example another ``limit``)."""

    @classmethod
    def limit_mismatch(cls, name: str, in_use: int, asked: int) -> AlreadyHeld:
        return cls(
            f"{name!r} is in use with limit={in_use}, and this caller asked for "
            f"limit={asked}. Every caller of a name must pass the same limit; "
            f"release every holder (manage.py djlocks release) before changing it."
        )


class LockLost(LockError):
    """The grant ended without its holder's release.

    Raised by ``check()``, ``release()`` and renewal when the lease expired,
    an operator forced a release, or the store's session ended.
    """


class BackendUnavailable(LockError):
    """The lock store could not be reached; the message names the store and the cause."""


class LockDeadlock(NotAcquired):
    """The database found that this wait completes a cycle of lock waits and refused it
    (PostgreSQL SQLSTATE 40P01, MySQL error 3058). Release what you hold and retry."""
