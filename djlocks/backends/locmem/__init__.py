"""The in-process backend: every grant lives in this process's memory.

``LocMemBackend`` locks between the threads of one process and nothing else:
another process, or another ``LocMemBackend`` instance, has its own store.
It exists for tests (see ``djlocks.testing``) and as the reference
implementation of ``LockBackend``: the smallest store that keeps the whole
contract, with each method's docstring saying what the contract requires of
every backend. The database and Redis backends keep the same promises with
SQL, Lua and server sessions; here each one is a few lines of Python.

The state is a dict of names, each with its limit, its last fence, its
grants by slot, its cool-downs by slot and its queue of waiters. One lock
guards all of it; each name has a ``threading.Condition`` on that lock, which
is notified whenever a slot of the name may have become free. The store's
clock is ``time.monotonic()``: leases, cool-downs and deadlines are judged by
it, and only shown as aware UTC datetimes.
"""

from djlocks.backends.locmem.backend import LocMemBackend

__all__ = ["LocMemBackend"]
