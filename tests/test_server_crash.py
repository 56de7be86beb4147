"""The database server is SIGKILLed during a grant storm, then started again.

Eight processes take and release a lock and a semaphore of three on a private
server of the leg's vendor (``tests.faults``), the server is killed, started
again (crash recovery), and the storm goes on. Then: every fence issued after
the restart is higher than every fence issued before the crash, the lock's
holders never overlapped and its fences rose in grant order, and each worker
came back, having failed meanwhile only with the errors a lost server gives.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
from django.db import connection

from djlocks.stress import current_database_names
from tests.faults import PrivateMariaDB, PrivatePostgreSQL
from tests.processes import finished, manage
from tests.workers import CONTEXT, grant_storm, start_worker

pytestmark = [
    pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite is a file, not a server"),
    pytest.mark.timeout(300),
]

WORKERS = 8
SEMAPHORE_LIMIT = 3
#: Seconds of storm before the crash, and after the restart.
BEFORE, AFTER = 2.0, 4.0
#: Seconds each worker has to get a grant, at first and after the restart.
RECOVERY = 60
#: What a worker may see while the server is down or just back.
SERVER_LOST = {"BackendUnavailable", "LockLost", "OperationalError", "InterfaceError"}

Server = PrivatePostgreSQL | PrivateMariaDB


@pytest.fixture(scope="module")
def private_server() -> Iterator[Server]:
    """A private server of this leg's vendor with the test database, migrated."""
    names = tuple(set(current_database_names().values()))
    server: Server = (
        PrivatePostgreSQL(databases=names)
        if connection.vendor == "postgresql"
        else PrivateMariaDB(databases=names)
    )
    try:
        port = {**os.environ, "DJLOCKS_DB_PORT": str(server.port)}
        migrate = manage("migrate", "--noinput", env=port, stdout=subprocess.DEVNULL)
        assert finished(migrate, 180) == 0
        yield server
    finally:
        server.stop()


@pytest.mark.catalogue("server-crash")
@pytest.mark.parametrize("backend", ["default", "session", "row"])
def test_every_fence_after_a_server_crash_is_higher_than_every_fence_before_it(
    backend: str, private_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DJLOCKS_DB_PORT", str(private_server.port))  # the workers' server
    lock, semaphore = f"crash:{backend}:lock", f"crash:{backend}:semaphore"
    stop, report = CONTEXT.Event(), CONTEXT.Queue()
    workers = [
        start_worker(grant_storm, *(lock, 1) if n % 2 else (semaphore, SEMAPHORE_LIMIT),
                     backend, stop, report)
        for n in range(WORKERS)
    ]  # fmt: skip
    pids = {worker.pid for worker in workers}
    outcomes: list[tuple[Any, ...]] = []
    try:
        _until_each_was_granted(report, pids, outcomes, server=private_server)
        time.sleep(BEFORE)
        crashed = time.monotonic()
        private_server.crash()
        private_server.start()
        restarted = time.monotonic()
        time.sleep(AFTER)
        # Every worker comes back: a row lock's waiters are served in no promised order,
        # so one may wait longer than AFTER for its first grant after the restart.
        _until_each_was_granted(report, pids, outcomes, server=private_server, since=restarted)
    finally:
        stop.set()
    outcomes += _gather(report, len(workers))
    for worker in workers:
        worker.join(30)
        assert worker.exitcode == 0
    grants = [o for o in outcomes if o[0] == "granted"]
    failures = {o[2] for o in outcomes if o[0] == "failed"}
    assert failures <= SERVER_LOST, failures
    for name_pids in (_pids(workers, odd=True), _pids(workers, odd=False)):
        mine = [g for g in grants if g[1] in name_pids]
        before = [fence for _, _, fence, granted, _ in mine if granted < crashed]
        after = [fence for _, _, fence, granted, _ in mine if granted > restarted]
        assert before and after
        assert min(after) > max(before), (max(before), min(after))
    held = sorted((granted, released, fence) for _, pid, fence, granted, released in grants
                  if pid in _pids(workers, odd=True))  # fmt: skip
    for (_, released, fence), (granted, _, next_fence) in pairwise(held):
        assert granted >= released, "two holders of the lock overlapped"
        assert next_fence > fence, "the lock's fences did not rise in grant order"


def _pids(workers: list[Any], odd: bool) -> set[int]:
    """The lock's workers (odd) or the semaphore's."""
    return {worker.pid for n, worker in enumerate(workers) if n % 2 == odd}


def _until_each_was_granted(
    report: Any, pids: set[int], outcomes: list[tuple[Any, ...]], *, server: Server,
    since: float = 0.0,
) -> None:  # fmt: skip
    """Read ``report`` into ``outcomes`` until every worker in ``pids`` had a grant
    after the monotonic time ``since`` (they go at their own pace: spawning and setting
    Django up, reconnecting), for at most ``RECOVERY`` seconds. A failure names the
    workers' last errors and the state of ``server``, with the end of its log."""
    waiting, deadline = set(pids), time.monotonic() + RECOVERY
    for outcome in outcomes:
        if outcome[0] == "granted" and outcome[3] > since:
            waiting.discard(outcome[1])
    while waiting:
        assert time.monotonic() < deadline, (
            f"{len(waiting)} worker(s) never came back; their last reports: "
            f"{[o for o in outcomes if o[1] in waiting][-5:]}; the server is "
            f"{'running' if server.running() else 'not running'}; its log ends:\n"
            f"{server.log()[-3000:]}"
        )
        outcome = report.get(timeout=RECOVERY)
        outcomes.append(outcome)
        if outcome[0] == "granted" and outcome[3] > since:
            waiting.discard(outcome[1])


def _gather(report: Any, workers: int) -> list[tuple[Any, ...]]:
    outcomes, done = [], 0
    while done < workers:
        outcome = report.get(timeout=60)
        done += outcome[0] == "done"
        outcomes.append(outcome)
    return outcomes
