"""How a backend waits: the caller's abort, deadlines, and the queue head's back-off.

Deadlines are ``time.monotonic()`` values (``None``: no deadline), never the
wall clock, so a clock jump neither shortens nor lengthens a wait.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Abort(threading.Event):
    """Set by another thread to end a blocked acquire early (asyncio cancellation, a signal).

    A backend that waits inside a server cannot be woken by the event alone:
    it registers a canceller with ``cancelling()``, which ``set()`` calls (in
    the setting thread), e.g. to kill the waiting connection.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cancellers: list[Callable[[], None]] = []
        self._cancellers_guard = threading.Lock()

    def set(self) -> None:
        """Set the flag, then call every registered canceller (in this thread)."""
        super().set()
        with self._cancellers_guard:
            cancellers = list(self._cancellers)
        for cancel in cancellers:
            cancel()

    @contextlib.contextmanager
    def cancelling(self, cancel: Callable[[], None]) -> Iterator[None]:
        """Call ``cancel`` if the abort is set while the block runs (perhaps twice)."""
        with self._cancellers_guard:
            self._cancellers.append(cancel)
        try:
            if self.is_set():
                cancel()
            yield
        finally:
            with self._cancellers_guard:
                self._cancellers.remove(cancel)


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), never negative; ``None`` stays."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


POLL_MIN = 0.001  # seconds; a queue's head polls from here ...
POLL_MAX = 0.004  # ... backing off to here


def poll_with_backoff(
    attempt: Callable[[], T | None], deadline: float | None, abort: Abort | None = None
) -> T | None:
    """Call ``attempt`` until it returns a value, sleeping ``POLL_MIN`` to ``POLL_MAX`` between.

    Only the head of a queue polls this way (the others wait in the server).
    Returns ``None`` when ``deadline`` passes or ``abort`` is set first.
    """
    pause = POLL_MIN
    while (outcome := attempt()) is None:
        left = seconds_left(deadline)
        if left == 0 or (abort is not None and abort.is_set()):
            return None
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 1.5, POLL_MAX)
    return outcome
