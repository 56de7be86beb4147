"""djlocks: locks and counting semaphores for Django, shared by every process
on every server that uses the same database or Redis."""

from djlocks.core import Lock, Semaphore, db_lock, db_semaphore
from djlocks.exceptions import (
    AlreadyHeld,
    BackendUnavailable,
    LockDeadlock,
    LockError,
    LockLost,
    NotAcquired,
    NotHeld,
    ReleaseRequested,
)
from djlocks.grant import Grant
from djlocks.leadership import Leadership, NotLeader, leadership
from djlocks.many import Locks, db_locks
from djlocks.rwlock import RWLock, db_rwlock

#: The one place the version is written; the package metadata reads it from here.
__version__ = "0.2.0"

__all__ = [
    "AlreadyHeld",
    "BackendUnavailable",
    "Grant",
    "Leadership",
    "Lock",
    "LockDeadlock",
    "LockError",
    "LockLost",
    "Locks",
    "NotAcquired",
    "NotHeld",
    "NotLeader",
    "RWLock",
    "ReleaseRequested",
    "Semaphore",
    "__version__",
    "db_lock",
    "db_locks",
    "db_rwlock",
    "db_semaphore",
    "leadership",
]
