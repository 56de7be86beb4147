"""The exception tree: every lock-state failure is a :class:`LockError`."""

from __future__ import annotations

from datetime import datetime


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


class ReleaseRequested(LockLost):
    """An operator asked the holder to give its grant back (a graceful release).

    The grant is still held: the store keeps it until the holder releases it,
    or until the operator's wait runs out, whichever comes first.
    ``seconds_left`` (float) is how long it may last at most, measured by the
    store when it answered; ``expires_at`` (``datetime`` or ``None``) is
    that end (in the project's time when ``Grant.check()`` raises it). Raised by
    ``Grant.check()`` (and by a backend's ``renew`` and ``is_held``); a subclass of
    ``LockLost``, so that a loop that stops on a lost grant stops here too. Release
    the grant to let the next waiter in.
    """

    def __init__(
        self, message: str, seconds_left: float = 0.0, expires_at: datetime | None = None
    ) -> None:
        super().__init__(message)
        self.seconds_left = seconds_left
        self.expires_at = expires_at

    def __reduce__(self) -> tuple[type[ReleaseRequested], tuple[str, float, datetime | None]]:
        return type(self), (str(self), self.seconds_left, self.expires_at)


class BackendUnavailable(LockError):
    """The lock store could not be reached; the message names the store and the cause."""


class LockDeadlock(NotAcquired):
    """This wait would complete a cycle of lock waits, so it was refused.

    Found by the database (PostgreSQL SQLSTATE 40P01, MySQL error 3058, an
    InnoDB deadlock between row locks), or by djlocks between session locks,
    whose server cannot see the cycle; this waiter is the one chosen to give up.
    Release what you hold and retry."""
