"""djlocks: locks and counting semaphores for Django, shared by every process
on every server that uses the same database or Redis."""

from djlocks.core import Lock, Semaphore, db_lock, db_semaphore
from djlocks.exceptions import AlreadyHeld, LockError, LockLost, NotAcquired, NotHeld

__all__ = [
    "AlreadyHeld",
    "Lock",
    "LockError",
    "LockLost",
    "NotAcquired",
    "NotHeld",
    "Semaphore",
    "db_lock",
    "db_semaphore",
]
