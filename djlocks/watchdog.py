"""The belief watchdog: tells a holder that its grant is lost as soon as its belief runs
out, even while the heartbeat's renewal of that grant hangs in the store's client.

A renewal that neither succeeds nor fails (a silent network partition: no reply and
no reset, until the client's socket time-out, if it has one) keeps the heartbeat's one
thread. The holder's belief still ends on time (``Grant.believed`` reads the local
monotonic clock); this thread makes ``on_lost`` and ``lock_lost`` hear of it then
too, before the lease can end at the store and another holder get it. It does no
I/O of its own: the loss goes into the history through the background writer (a
crash before the writer's next batch loses that record). A grant held past its
``max_hold`` is taken back at its store by the heartbeat, once it can.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING

from djlocks.own_thread import OwnThread

if TYPE_CHECKING:
    from djlocks.grant import Grant

watchdog_log = logging.getLogger("djlocks.renew")


class Watchdog:
    """Marks each watched grant lost when its belief runs out, on a daemon thread."""

    def __init__(self) -> None:
        self.forget_the_parent()

    def forget_the_parent(self) -> None:
        """Start empty: at first, and in a forked child (its parent's grants are the
        parent's, and its thread did not come along)."""
        self._guard = threading.Lock()  # a plain lock: cheaper to take than the Condition
        self._wake = threading.Condition(self._guard)
        self._grants: set[Grant] = set()
        self._own = OwnThread(self._guard, self._tell_when_ran_out, "djlocks-watchdog")
        self._stopping = False
        #: The monotonic time the thread sleeps until: ``math.inf`` until woken,
        #: ``-math.inf`` while it is awake (it reads the grants before it sleeps again).
        self._sleeping_until = -math.inf
        #: The earliest deadline announced to the thread that has not passed yet, kept
        #: after its grant is discarded: the thread sleeps until then, not until woken,
        #: so that the next grants' later deadlines need no wake-up (else, on a busy
        #: machine where the thread runs late, each grant would wake it).
        self._planned = math.inf

    def watch(self, grant: Grant) -> None:
        """Mark ``grant`` lost once ``grant.believe_until()`` passes, unless discarded."""
        with self._guard:
            self._grants.add(grant)
            deadline = grant.believe_until()
            self._planned = min(self._planned, deadline)
            if deadline < self._sleeping_until:
                self._wake.notify()  # else the thread wakes first, and sees this grant then
            self._own.start_unless_running()

    def moved_earlier(self, grant: Grant) -> None:
        """``grant``'s belief now ends earlier than before (a renewal that found a shorter
        lease): wake the thread if it would sleep past the new deadline."""
        with self._guard:
            if grant not in self._grants:
                return  # released, or already told
            deadline = grant.believe_until()
            self._planned = min(self._planned, deadline)
            if deadline < self._sleeping_until:
                self._wake.notify()

    def discard(self, grant: Grant) -> None:
        """Stop watching ``grant`` (released, or lost already)."""
        with self._guard:
            self._grants.discard(grant)

    def stop(self, wait: float = 1.0) -> None:
        """Watch no more; wait up to ``wait`` seconds for listeners being told to return."""
        with self._guard:
            self._stopping = True
            self._wake.notify()
            thread = self._own.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait)

    def _tell_when_ran_out(self) -> None:
        while (ran_out := self._next_ran_out()) is not None:
            for grant in ran_out:
                if time.monotonic() < grant.believe_until():  # renewed since: watch on
                    self.watch(grant)
                    continue
                try:
                    grant.mark_lost(grant.ran_out_reason(), record_in_background=True)
                except Exception:  # an on_lost callback or lock_lost receiver that raised
                    watchdog_log.exception("telling the holder of %s of its loss failed", grant)

    def _next_ran_out(self) -> list[Grant] | None:
        """Wait until some watched grants' belief ran out; return them (no longer watched),
        or ``None`` once stopped. A renewal moves a deadline later: the wait still ends at
        the deadline it was set for, finds nothing ran out, and waits again."""
        with self._guard:
            while not self._stopping:
                now = time.monotonic()
                ran_out = [grant for grant in self._grants if grant.believe_until() <= now]
                if ran_out:
                    self._grants.difference_update(ran_out)
                    return ran_out
                if self._planned <= now:
                    self._planned = math.inf
                self._sleeping_until = min(
                    [self._planned, *(grant.believe_until() for grant in self._grants)]
                )
                self._wake.wait(
                    None if self._sleeping_until == math.inf else self._sleeping_until - now
                )
                self._sleeping_until = -math.inf
            return None


watchdog = Watchdog()
os.register_at_fork(after_in_child=watchdog.forget_the_parent)
