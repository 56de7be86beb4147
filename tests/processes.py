"""Helpers for tests that run manage.py commands as real processes and watch them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Collection
from pathlib import Path

from djlocks.stress import current_database_names, manage_command
from tests.faults import until


def manage(
    *args: str, names: dict[str, str] | None = None, **popen: object
) -> subprocess.Popen[str]:
    """``manage.py ARGS`` against the test database (or the database ``names`` of each
    alias), as a real process."""
    command = [*manage_command(names or current_database_names()), *args]
    return subprocess.Popen(command, text=True, **popen)  # type: ignore[call-overload]


def runlocked(*args: str, **popen: object) -> subprocess.Popen[str]:
    return manage("runlocked", *args, **popen)


def finished(process: subprocess.Popen[str], timeout: float = 30) -> int:
    return process.wait(timeout)


def wait_for_file(path: Path, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.02)
    return path.read_text().strip()


def resume(pid: int) -> None:
    """SIGCONT to a paused process, if it still exists: a test's cleanup resumes a worker
    that may have ended, and the forkserver reaps a worker the moment it ends."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # it died, and was reaped, since the signal
        return False
    # A zombie (dead, not yet reaped by its parent) counts as dead.
    return "zombie" not in status.lower()


def wait_until_dead(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.02)


def advisory_lock_process(keys: Collection[int], *, granted: bool) -> tuple[int, int]:
    """The PostgreSQL server process, of the test database, that holds (``granted``) or
    waits for the advisory lock of one of ``keys``; and that key. Waits up to 10 s."""
    from django.db import connection

    from djlocks.backends.sql.postgresql import LOCK_KEY

    found: list[tuple[int, int]] = []

    def look() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT l.pid, {LOCK_KEY} FROM pg_locks l "
                f"JOIN pg_database d ON d.oid = l.database AND d.datname = current_database() "
                f"WHERE l.locktype = 'advisory' AND l.granted = %s AND {LOCK_KEY} = ANY(%s)",
                (granted, list(keys)),
            )
            found.extend((int(pid), int(key)) for pid, key in cursor.fetchall())
        return bool(found)

    until(look, "a session to hold or wait for the advisory lock", timeout=10)
    return found[0]


def fork_beside_threads() -> int:
    """``os.fork()`` in a process that runs threads, which Python 3.12+ warns of: the
    child's pid in the parent, 0 in the child."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()
