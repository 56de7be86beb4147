"""A fenced resource accepts only the newest holder's writes."""

from __future__ import annotations

import time

import pytest

from djlocks import Lock, LockLost, db_lock
from djlocks.fencing import StaleFence, fenced_update
from project.demo.models import FencedCounter

pytestmark = pytest.mark.usefixtures("store")


def test_a_late_holder_is_refused_after_a_newer_one_wrote() -> None:
    FencedCounter.objects.create(name="o3")
    rows = FencedCounter.objects.filter(name="o3")
    stale = Lock("fencing:o3", ttl=0.4, renew=False)
    old = stale.__enter__()
    time.sleep(0.6)  # the paused holder's lease runs out
    with db_lock("fencing:o3", timeout=1) as new:
        assert new.fence > old.fence
        assert fenced_update(rows, new.fence, value=2) == 1
    with pytest.raises(StaleFence):
        fenced_update(rows, old.fence, value=1)
    assert (rows.get().value, rows.get().fence) == (2, new.fence)
    with pytest.raises(LockLost):
        stale.release()


def test_the_same_holder_may_write_again() -> None:
    FencedCounter.objects.create(name="again")
    rows = FencedCounter.objects.filter(name="again")
    with db_lock("fencing:again", timeout=1) as grant:
        assert fenced_update(rows, grant.fence, value=1) == 1
        assert fenced_update(rows, grant.fence, value=2) == 1
    assert rows.get().value == 2
    assert fenced_update(FencedCounter.objects.filter(name="missing"), 1, value=3) == 0
