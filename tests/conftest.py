"""Every test runs against the real database picked by DJLOCKS_DB; a server that
is down fails the run (pytest-django cannot create the test database), never skips."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from djlocks.backends import backends
from djlocks.heartbeat import heartbeat
from djlocks.models import LeaseWaiter


@pytest.fixture
def store(transactional_db: None) -> Iterator[None]:
    """A clean lease store; afterwards nothing may be left behind (oracle O4)."""
    yield
    assert heartbeat.active() == 0, "a renewal is still running after the test"
    lease = backends["default"]
    assert lease.holders() == [], "a live grant was left"
    assert lease.waiters() == [], "a live waiter record was left"
    assert not LeaseWaiter.objects.filter(pid=os.getpid()).exists(), "this process left a waiter"
    backends.reset()
