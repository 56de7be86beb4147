"""The threads that async acquires wait in (``aacquire``, ``async with``).

An acquire made from async code waits in a thread, so that the event loop
goes on meanwhile. Those threads are djlocks' own, never the loop's default
executor: there the waits would take every thread (six on a 2-core machine),
and the releases that end them, which run there, would find none left, so
the waits could only time out, or never end. Here at most
``ASYNC_WAIT_THREADS`` waits run at once, in threads that live as long as the
process and keep their database connections; more queue for a thread, and
the time they queue counts against their timeout.

A task that already holds a grant never queues for one of those threads: the
waits ahead of it may be waiting for that very grant, which it releases only
once its own acquire ends (``async with a: async with b:`` in more tasks than
there are threads would otherwise wait for ever). Its acquires wait in a second
set of threads, as many as such acquires run at once (each thread is kept for
the next): there are never more of them than tasks that hold a grant.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

from djlocks.forksafe import fork_safe_lock

#: How many async acquires of a process wait in the server at once.
ASYNC_WAIT_THREADS = 32
#: The most threads for the acquires of tasks that hold a grant: a bound only in name.
HOLDERS_WAIT_THREADS = 10_000

#: How many grants the running task got from async acquires and has not released.
_held_by_task: ContextVar[int] = ContextVar("djlocks_held_by_task", default=0)

_guard = fork_safe_lock()
#: The process that made the threads, and its two sets of them.
_threads: tuple[int, ThreadPoolExecutor, ThreadPoolExecutor] | None = None


def wait_threads() -> ThreadPoolExecutor:
    """The threads the running task's next acquire waits in: this process's
    ``ASYNC_WAIT_THREADS``, or, for a task that holds a grant, threads of their own
    (a forked child makes its own: its parent's threads did not come along)."""
    global _threads
    with _guard:
        if _threads is None or _threads[0] != os.getpid():
            _threads = (
                os.getpid(),
                ThreadPoolExecutor(ASYNC_WAIT_THREADS, thread_name_prefix="djlocks-async-wait"),
                ThreadPoolExecutor(HOLDERS_WAIT_THREADS, thread_name_prefix="djlocks-async-holder"),
            )
        return _threads[2] if _held_by_task.get() else _threads[1]


def task_granted() -> None:
    """The running task got a grant from an async acquire."""
    _held_by_task.set(_held_by_task.get() + 1)


def task_released() -> None:
    """The running task gave back a grant it got from an async acquire."""
    _held_by_task.set(max(0, _held_by_task.get() - 1))
