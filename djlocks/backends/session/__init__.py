"""Session locks: the database server holds the lock for as long as a session lives.

``GET_LOCK`` (MySQL/MariaDB) and ``pg_advisory_lock`` (PostgreSQL) belong to
the server session that took them, and the server frees them the moment that
session ends, so a crashed holder can never leak one. The subclasses in
``djlocks.backends.mysql`` and ``djlocks.backends.postgresql`` give the SQL;
this package gives the rules that keep them honest:

* Every grant has its own connection, opened and owned by djlocks:
  never the request's or the caller's transaction's, never shared by two
  holders (both servers let one session take the same lock twice, so two
  holders on one connection would both get in), never used after ``fork()``.
  A released grant's connection goes back to a per-process idle list.
* A blocking acquire waits inside the server; if the caller gives up while
  the server may still grant (an abort, an error), the connection is killed
  from another connection and discarded: whatever it was granted dies with it.
* Fences and identity live in two small tables (``djlocks.models``), written
  right after the grant; whether a grant is live is always the server's
  word (``IS_USED_LOCK``, ``pg_locks``), never the table's.
* The heartbeat's renewal is a keep-alive that asks the server whether this
  session still holds the key: a killed or timed-out session is reported
  ``LockLost`` within one heartbeat (TTL/3).
* A pooler that shares server sessions between clients (PgBouncer in
  transaction or statement pooling mode) is refused before the first grant:
  through it, a lock would belong to whichever client the pooler hands that
  server session to next. It is recognised by what it does: two djlocks
  connections that are open at once are given the same server session.
* A semaphore is N slot keys. One statement tries them all (a ``CASE``,
  which stops at the first slot it gets, so it takes at most one). If all are
  taken the caller waits in the server for the name's gate key, behind the
  other waiters. The gate's holder waits in the server too, on the slot whose
  holder was granted longest ago (the lowest fence in the holder rows: with
  similar hold times, the next slot to come free), for at most ``SLOT_WAIT``
  seconds at a time before it tries them all again. So a slot passes to the
  next waiter as soon as its holder releases it, with no polling, while a
  slot held for long cannot hold up the others' hand-offs by more than
  ``SLOT_WAIT``.
"""

from djlocks.backends.session.backend import SessionBackend
from djlocks.backends.session.connections import Key, Session

__all__ = ["Key", "Session", "SessionBackend"]
