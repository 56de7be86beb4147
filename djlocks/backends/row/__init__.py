"""Row locks: ``djlocks.backends.row.RowLockBackend``, a lock that ends with the transaction.

``with transaction.atomic(): with db_lock("account:7", backend="row"): ...``
locks a djlocks row with ``SELECT ... FOR UPDATE`` in the caller's own
transaction. The commit or rollback of that transaction unlocks it, so the
lock always covers the commit of what it guards, and a
holder that crashes or loses its connection frees it at once. Releasing early
is impossible by design: leaving the ``with`` block (or ``release()``) ends
the handle's grant, and the row stays locked until the transaction ends. Used
outside a transaction, the ``with`` block (or ``acquire()`` ... ``release()``
in one thread) opens one for its duration: committed at the end, rolled back
if the block raises. The transaction belongs to the acquiring thread, so such
a grant is released from that thread, and ``async with`` is refused.

The dialects (``row.postgresql``, ``row.mysql``, ``row.sqlite``) give the
SQL. Common to all:

* An uncontended acquire is one statement, ``FOR UPDATE SKIP LOCKED`` (which
  neither waits nor fails, so it needs no savepoint); ``timeout=0`` stops
  there. A contended one waits in the server under the database's own lock
  wait limit and ends in ``None`` (``NotAcquired``) with the caller's
  transaction still usable.
* Fences and holder identity are written on djlocks' own connection right
  after the grant (``server_records``): a rolled-back transaction never gets
  its fence handed out again. SQLite, whose one writer is the caller's
  transaction, is the exception (see ``row.sqlite``).
* Holders and waiters are the server's lock state (``pg_locks`` with
  ``pg_stat_activity``; InnoDB's transactions and the process list) joined
  with djlocks' holder rows. Forced release terminates the holder's
  connection: its transaction rolls back.
"""

from djlocks.backends.row.backend import RowLockBackend

__all__ = ["RowLockBackend"]
