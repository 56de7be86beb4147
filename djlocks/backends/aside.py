"""Threads that end another thread's statement from the side: a cancel, a kill.

An aborted wait (``Abort``) is ended by a thread of its own, on a connection of
its own, since the waiting thread is blocked in its statement. Such a thread may
still run when ``backends.reset()`` closes every djlocks connection: closing a
connection while another thread's statement runs on it frees what that thread is
reading (a crash, in psycopg). ``reset()`` therefore first waits for them
(``wait_for_all``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from djlocks.forksafe import fork_safe_lock

#: Seconds ``backends.reset()`` waits for the threads still ending a statement; a
#: kill waits up to 5 s for its victim to end (``pg_terminate_backend``'s timeout).
RESET_WAIT = 10.0

_running: set[threading.Thread] = set()
_guard = fork_safe_lock()


def start(end_statement: Callable[[], None]) -> None:
    """Run ``end_statement`` in a new daemon thread, ``djlocks-cancel``, that
    ``wait_for_all()`` waits for."""

    def run() -> None:
        try:
            end_statement()
        finally:
            with _guard:
                _running.discard(thread)

    thread = threading.Thread(target=run, name="djlocks-cancel", daemon=True)
    with _guard:
        _running.add(thread)
    try:
        thread.start()
    except BaseException:  # no thread to wait for ("can't start new thread")
        with _guard:
            _running.discard(thread)
        raise


def wait_for_all(seconds: float = RESET_WAIT) -> None:
    """Wait until every thread ``start()`` began has ended, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    with _guard:
        threads = list(_running)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _forget_the_parents() -> None:
    """A forked child runs none of its parent's threads."""
    _running.clear()


os.register_at_fork(after_in_child=_forget_the_parents)
