"""The threads that async acquires wait in (``aacquire``, ``async with``).

An acquire made from async code waits in a thread, so that the event loop
goes on meanwhile. Those threads are djlocks' own, never the loop's default
executor: there the waits would take every thread (six on a 2-core machine),
and the releases that end them, which run there, would find none left, so
the waits could only time out, or never end. Here at most
``ASYNC_WAIT_THREADS`` waits run at once, in threads that live as long as the
process and keep their database connections; more queue for a thread, and
the time they queue counts against their timeout.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from djlocks.forksafe import fork_safe_lock

#: How many async acquires of a process wait in the server at once.
ASYNC_WAIT_THREADS = 32

_guard = fork_safe_lock()
_threads: tuple[int, ThreadPoolExecutor] | None = None  # the process that made them


def wait_threads() -> ThreadPoolExecutor:
    """This process's threads for async waits (a forked child makes its own: its
    parent's threads did not come along)."""
    global _threads
    with _guard:
        if _threads is None or _threads[0] != os.getpid():
            pool = ThreadPoolExecutor(ASYNC_WAIT_THREADS, thread_name_prefix="djlocks-async-wait")
            _threads = (os.getpid(), pool)
        return _threads[1]
