"""What djlocks runs on PostgreSQL: every statement, error code and server query."""

from __future__ import annotations

# -- Lease rows (djlocks.backends.lease) ------------------------------------


# -- Session locks (djlocks.backends.session) ---------------------------------


# -- Row locks (djlocks.backends.row) -------------------------------------------


# -- Server sessions: who waits, who holds, killing a session -------------------
