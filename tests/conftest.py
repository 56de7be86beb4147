"""Every test runs against the real database picked by DJLOCKS_DB; a server that
is down fails the run (pytest-django cannot create the test database), never skips."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from djlocks.backends import backends
from djlocks.heartbeat import heartbeat
from djlocks.models import LeaseWaiter
from tests.catalogue import Recorder, column_of, unknown_slugs
from tests.redis_cluster import channels_at

CATALOGUE = Recorder()
#: Fixtures that start a private Redis server for the test.
PRIVATE_REDIS_FIXTURES = {"private_redis", "stoppable_redis", "replicated"}
#: The test settings' Redis backends: a server, and a cluster where one was started
#: (``tests/redis_cluster.py``).
REDIS_BACKENDS = ("redis", "redis-cluster")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "catalogue(*slugs, backend=ALIAS): the fault catalogue items (by slug, such as "
        "'holder-killed') this test proves for the backend ALIAS (or for its `backend` "
        "parameter); see tests/catalogue.py",
    )
    config.addinivalue_line(
        "markers",
        "redis_store: a test of the Redis backend, whose database holds only its history "
        "(set by conftest; `make test` runs these in the SQLite leg only)",
    )
    config.addinivalue_line(
        "markers",
        "real_workers: runs real web or task-queue workers (gunicorn, uvicorn, Celery); "
        "`make test-newest` leaves these out: they test the workers, not Django",
    )
    config.addinivalue_line(
        "markers",
        "one_database: what it tests is the same on every database (real workers whose "
        "renewals do not depend on the driver, the command line's strength tests); `make "
        "test` runs it in the PostgreSQL leg only",
    )
    config.addinivalue_line(
        "markers",
        "strength: a strength test, many processes contending for a store; `make "
        "test-newest` leaves these out: they test the stores, not Django",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for test in items:
        unknown = unknown_slugs(test)
        if unknown:
            raise pytest.UsageError(
                f"{test.nodeid}: not in the fault catalogue (tests/catalogue.py): "
                + ", ".join(unknown)
            )
        if _tests_the_redis_store(test):
            test.add_marker("redis_store")


def _tests_the_redis_store(test: pytest.Item) -> bool:
    """Whether ``test`` is about the Redis backend: its ``backend`` parameter is
    ``redis`` or ``redis-cluster``, it is in test_redis_backend.py, or it starts a private Redis."""
    callspec = getattr(test, "callspec", None)
    if callspec is not None and callspec.params.get("backend") in REDIS_BACKENDS:
        return True
    if test.path.name == "test_redis_backend.py":
        return True
    return bool(PRIVATE_REDIS_FIXTURES & set(getattr(test, "fixturenames", ())))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    CATALOGUE.note(item, report)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    CATALOGUE.write()


@pytest.fixture
def bounds(request: pytest.FixtureRequest) -> Callable[[str, float], None]:
    """``bounds(what, seconds)`` records a measured bound of this catalogue test's backend."""
    key = column_of(request.node)
    return lambda what, seconds: CATALOGUE.bound(what, key, seconds)


@pytest.fixture
def store(transactional_db: None) -> Iterator[None]:
    """Clean lease stores; afterwards nothing may be left behind (no grant,
    waiter record, key, subscription or renewal thread).

    The test database is flushed by pytest-django; the Redis keys under the
    backend's prefix are deleted here, before the test.
    """
    if "redis" not in backends.aliases():
        pytest.fail(
            "These tests need a Redis: set REDIS_URL (make test sets "
            "redis://127.0.0.1:6379/0), and project/settings.py configures the redis backend."
        )
    stores = [backends[alias] for alias in REDIS_BACKENDS if alias in backends.aliases()]
    for redis in stores:
        stale = list(redis.redis().scan_iter(match=f"{redis.prefix}:*", count=1000))
        if stale:
            redis.redis().delete(*stale)
    yield
    assert heartbeat.active() == 0, "a renewal is still running after the test"
    lease = backends["default"]
    assert lease.holders() == [], "a live grant was left"
    assert lease.waiters() == [], "a live waiter record was left"
    assert not LeaseWaiter.objects.filter(pid=os.getpid()).exists(), "this process left a waiter"
    for redis in stores:
        assert redis.holders() == [], f"a Redis lease was left ({redis.alias})"
        assert redis.waiters() == [], f"a Redis waiter was left ({redis.alias})"
    backends.reset()
    for redis in stores:
        channels = channels_at(redis.redis(), f"{redis.prefix}:wake:*:{os.getpid()}:*")
        redis.close_client()  # the one this check made
        assert not any(channels.values()), (
            f"a wake-up subscription outlived backends.reset() ({redis.alias}): {channels}"
        )
