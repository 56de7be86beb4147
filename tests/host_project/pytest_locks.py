"""The host project's pytest-django tests (copied in as test_locks.py), with `locmem_locks`."""

from djlocks import Lock, db_lock


def test_the_fixture_gives_an_empty_in_process_store(locmem_locks) -> None:
    assert locmem_locks.holders() == []
    with db_lock("smoke:pytest", timeout=1) as grant:
        assert [holder.fence for holder in locmem_locks.holders()] == [grant.fence]
        assert not Lock("smoke:pytest").acquire(timeout=0)
    assert locmem_locks.holders() == []
