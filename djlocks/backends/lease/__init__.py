"""The lease backend: locks and semaphore slots as rows that expire.

``djlocks.backends.lease.LeaseBackend`` is the public path that settings name.

Tables (``djlocks.models``): ``djlocks_lease_slot`` holds one row per slot of a
name (``limit`` rows, created on first use); ``djlocks_lease_waiter`` holds one
row per waiting process, its ``id`` being its ticket in the FIFO queue.

Every decision "free or expired?" is taken inside one SQL statement with the
database's clock (``statement_timestamp()`` on PostgreSQL, ``UTC_TIMESTAMP(6)``
on MySQL/MariaDB, ``strftime('%Y-%m-%d %H:%M:%f', 'now')`` on SQLite: the
``LEASE`` dialect of each module of ``djlocks.backends.sql``). Release and
renewal are compare-and-act on the grant's random token.

* A lock (limit 1) is claimed by one ``UPDATE`` that also issues the fence
  and refuses to pass a live waiter of the queue (``claims``).
* A semaphore slot, the first use of a name and any disagreement about the
  limit go through a short transaction that locks the name's slot rows.
* Waiters queue in ticket order (``queue``); on PostgreSQL a release
  ``NOTIFY``s them, elsewhere the queue's head polls with back-off.
* A forced release clears the grant's token; a graceful release's request sets
  ``release_by`` (the operator's wait), past which renewals no longer extend
  the lease. On PostgreSQL both ``NOTIFY`` the holders, whose process listens
  (``push.PostgresListener``) and renews at once.
"""

from djlocks.backends.lease.backend import LeaseBackend

__all__ = ["LeaseBackend"]
