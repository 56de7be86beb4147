"""The background thread of one djlocks object: the heartbeat, the watchdog, a
background writer, the session watcher.

It is started when first needed, under the object's guard, and it forgets itself,
under that guard, as it ends: whether one runs is then known from ``thread`` alone,
with no ``is_alive()`` asked of it at every grant.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class OwnThread:
    """The daemon thread named ``name`` that runs ``work`` for an object whose state
    ``guard`` protects; ``thread`` is it while it runs, else ``None``."""

    def __init__(self, guard: threading.Lock, work: Callable[[], None], name: str) -> None:
        self._guard = guard
        self._work = work
        self._name = name
        self.thread: threading.Thread | None = None

    def start_unless_running(self) -> None:
        """Start the thread if none runs; call with ``guard`` held."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self.thread.start()

    def ending(self) -> None:
        """Forget the thread now: call from it, with ``guard`` held, as it decides to
        end, so that work handed over from then on starts a new one."""
        self.thread = None

    def _run(self) -> None:
        try:
            self._work()
        finally:
            with self._guard:
                if self.thread is threading.current_thread():
                    self.thread = None
