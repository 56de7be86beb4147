"""Waking the lease waiters of a SQLite database: a datagram between processes of its host.

Every process that uses a SQLite database file runs on the host that has the
file, so the operating system can carry a release's news to the waiters,
where PostgreSQL has ``NOTIFY`` and MariaDB ``KILL QUERY``. A waiter binds a Unix
datagram socket named after the database file and its ticket in Linux's
abstract socket namespace (no file to create or clean up; the name goes when
the socket closes) and waits on it between its checks of the queue. A release
that frees a slot sends an empty datagram to the first ``limit`` live waiters
of the name, whose tickets the releasing ``UPDATE`` returns. A datagram is
only a hint: the woken waiter checks the store as it would after a poll.

Where there is no abstract namespace (not Linux) or a datagram cannot arrive
(processes in different network namespaces, such as containers sharing the
file), waiters fall back to polling.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import socket
import sys
from collections.abc import Iterable

#: Whether this system has Linux's abstract Unix socket namespace.
ABSTRACT_NAMESPACE = sys.platform.startswith("linux")


class HostWakeups:
    """The wake-ups of the lease waiters of one SQLite database file ``database``."""

    def __init__(self, database: str) -> None:
        digest = hashlib.sha256(os.path.realpath(database).encode()).hexdigest()[:24]
        self._prefix = f"\0djlocks-lease-{digest}-"

    def _address(self, ticket: int) -> str:
        return f"{self._prefix}{ticket}"

    def open(self, ticket: int) -> socket.socket | None:
        """The socket the waiter ``ticket`` is woken on, or ``None`` where it cannot have
        one (not Linux, or the system refused: then it polls). Never raises."""
        if not ABSTRACT_NAMESPACE:
            return None
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return None
        try:
            listener.bind(self._address(ticket))
            listener.setblocking(False)
        except OSError:
            listener.close()
            return None
        return listener

    def wake(self, tickets: Iterable[int]) -> None:
        """Send each waiter of ``tickets`` a wake-up; one that has gone, or cannot take
        it now, is skipped (it polls). Never raises."""
        if not ABSTRACT_NAMESPACE:
            return
        try:
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return
        with sender:
            sender.setblocking(False)
            for ticket in tickets:
                with contextlib.suppress(OSError):
                    sender.sendto(b"", self._address(ticket))

    @staticmethod
    def wait(listener: socket.socket, seconds: float) -> bool:
        """Wait up to ``seconds`` (a float, in seconds) for a wake-up on ``listener``;
        whether one came. Every wake-up that came is consumed."""
        poller = select.poll()  # not select(): a descriptor may be above FD_SETSIZE
        poller.register(listener, select.POLLIN)
        if not poller.poll(max(seconds, 0.0) * 1000):
            return False
        with contextlib.suppress(BlockingIOError):
            while True:
                listener.recv(1)
        return True
