"""The threads that async acquires wait in (``aacquire``, ``async with``).

An acquire made from async code waits in a thread, so that the event loop
goes on meanwhile. Those threads are djlocks' own, never the loop's default
executor: there the waits would take every thread (six on a 2-core machine),
and the releases that end them, which run there, would find none left, so
the waits could only time out, or never end. Here at most
``ASYNC_WAIT_THREADS`` waits run at once, in threads that live as long as the
process and keep their database connections; more queue for a thread, and
the time they queue counts against their timeout.

A task that holds a grant it got from an async acquire never queues for one of
those threads: the waits ahead of it may be waiting for that very grant, which
it releases only once its own acquire ends (``async with a: async with b:`` in
more tasks than there are threads would otherwise wait for ever). Its acquires
wait in a second set of threads, made as such acquires need them and kept for
the next: at most as many as tasks that hold a grant and acquire another at the
same moment, each thread with its own database connections. A task's child
tasks do not count as holders: a child that waits for a lock its parent holds
waits for ever wherever it waits.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TYPE_CHECKING

from djlocks.forksafe import fork_safe_lock

if TYPE_CHECKING:
    from djlocks.grant import Grant

#: How many async acquires of a process wait in the server at once.
ASYNC_WAIT_THREADS = 32
#: The most threads for the acquires of tasks that hold a grant: no bound in practice
#: (see the module's docstring).
HOLDERS_WAIT_THREADS = 10_000

#: The task whose context this is (a child task inherits its parent's context, but
#: not its grants), and the grants it got from async acquires.
_task_grants: ContextVar[tuple[object, tuple[Grant, ...]]] = ContextVar(
    "djlocks_task_grants", default=(None, ())
)

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
        threads = _threads
    return threads[2] if _holds_grants() else threads[1]


def task_granted(grant: Grant) -> None:
    """The running task got ``grant`` from an async acquire (its grants that ended are
    forgotten meanwhile)."""
    task = _current_task()
    owner, grants = _task_grants.get()
    held = tuple(earlier for earlier in grants if earlier.believed) if owner is task else ()
    _task_grants.set((task, (*held, grant)))


def _holds_grants() -> bool:
    owner, grants = _task_grants.get()
    return owner is _current_task() and any(grant.believed for grant in grants)


def _current_task() -> object:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        return None
