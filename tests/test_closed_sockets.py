"""``ClosedSockets``: the watch on a session's socket that tells a holder at once when
the server closed its connection (a forced release), on real sockets."""

from __future__ import annotations

import socket
import threading

import pytest

from djlocks.backends.push import ClosedSockets

pytestmark = pytest.mark.skipif(not ClosedSockets.supported, reason="POLLRDHUP is Linux's")

#: Seconds a watch may take to fire: the thread takes up new watches within a poll slice.
FIRES_WITHIN = 5.0


def test_each_watch_on_a_socket_fires_once_when_its_peer_hangs_up() -> None:
    """A released grant's watch may still be on its session's socket when the next
    grant of that session watches it: the next one must hear of the hang-up too."""
    ours, peer = socket.socketpair()
    watches = ClosedSockets()
    released, next_grant, ended = threading.Event(), threading.Event(), threading.Event()
    try:
        watches.watch("released", ours.fileno(), released.set)
        watches.watch("next", ours.fileno(), next_grant.set)
        end = watches.watch("ended", ours.fileno(), ended.set)
        end()
        peer.close()
        assert next_grant.wait(FIRES_WITHIN)
        assert released.wait(FIRES_WITHIN)
        assert not ended.is_set()
    finally:
        ours.close()


def test_a_watch_does_not_fire_while_the_peer_only_talks() -> None:
    """Data (a keep-alive's reply) is not a hang-up."""
    ours, peer = socket.socketpair()
    watches = ClosedSockets()
    heard = threading.Event()
    try:
        end = watches.watch("grant", ours.fileno(), heard.set)
        peer.sendall(b"reply")
        assert not heard.wait(0.5)
        end()
    finally:
        ours.close()
        peer.close()
