"""SQLite lease operations take turns at a file lock beside the database (``lease.gate``).

Without it, a newcomer that found SQLite's write lock taken slept in SQLite's busy
handler while a process that released and claimed in a loop committed again
and again: it was overtaken by grants it had asked before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from djlocks import db_lock
from djlocks.backends.lease.gate import NEXT, TURN, WriteGate, write_gate
from djlocks.backends.sqlite_checks import database_file
from tests.faults import until
from tests.processes import fork_beside_threads
from tests.workers import CONTEXT, start_worker, take_and_release_until

pytestmark = pytest.mark.timeout(120)

#: Seconds after which a turn that should have been given is taken as never given.
PATIENCE = 5.0
#: Times a newcomer asks for a lock that another process releases and claims in a loop.
ROUNDS = 100


@pytest.mark.skipif(
    connection.vendor != "sqlite",
    reason="not applicable: the servers' queues are entered in the server (the sqlite run)",
)
@pytest.mark.usefixtures("store")
def test_a_newcomer_is_not_overtaken_by_a_process_that_releases_and_claims_in_a_loop() -> None:
    """Each time the newcomer asks, the looping process may finish the grant it had,
    and at times one it was claiming as the newcomer asked: about one per round
    (0.5 to 0.7 with two processes spinning on this machine's two cores). Before
    the turns, the newcomer slept in SQLite's busy handler while the loop went on:
    3 to 6 grants per round, 20 to 50 in some."""
    stop, grants = CONTEXT.Event(), CONTEXT.Value("q", 0)
    looper = start_worker(take_and_release_until, "gate:loop", stop, grants)
    overtaken = []
    try:
        until(lambda: grants.value >= 20, timeout=60, what="the loop's first grants")
        with db_lock("gate:loop", timeout=30):  # this process's connection opens: not timed
            pass
        for _ in range(ROUNDS):
            asked = grants.value
            with db_lock("gate:loop", timeout=30):
                overtaken.append(grants.value - asked)
            time.sleep(0.005)  # the loop takes the lock again meanwhile
    finally:
        stop.set()
        looper.join(30)
    assert looper.exitcode == 0
    assert sum(overtaken) <= 2 * ROUNDS, (
        f"grants that overtook the newcomer, per round: {overtaken}"
    )


def _blocks_until_given_up(gate: WriteGate, give_up: Any) -> None:
    """Assert that a new thread's turn at ``gate`` waits while the turn is held elsewhere,
    and begins once ``give_up()`` ends that turn (given up whatever happens, so that a
    failure leaves no thread waiting)."""
    entered = threading.Event()

    def other() -> None:
        with gate.turn():
            entered.set()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    try:
        assert not entered.wait(0.3), "got a turn that was held elsewhere"
    finally:
        give_up()
    assert entered.wait(PATIENCE), "never got the turn given up"
    thread.join(PATIENCE)


def test_threads_of_one_process_take_turns(tmp_path: Path) -> None:
    gate = WriteGate(str(tmp_path / "db.sqlite3"))
    turn = gate.turn()
    turn.__enter__()
    _blocks_until_given_up(gate, lambda: turn.__exit__(None, None, None))


def test_a_turn_inside_a_turn_is_already_held(tmp_path: Path) -> None:
    gate = WriteGate(str(tmp_path / "db.sqlite3"))
    outer = gate.turn()
    outer.__enter__()
    with gate.turn():  # no second flock, which would wait for this thread's own
        pass
    _blocks_until_given_up(gate, lambda: outer.__exit__(None, None, None))


@pytest.mark.timeout(10)
def test_one_gate_per_database_file_so_a_turn_never_waits_for_itself(tmp_path: Path) -> None:
    """Two gates of one file (two backends on it, or two threads making a backend's
    first at once) would each open their own descriptors: a turn held through one
    would wait for itself at the other, for ever."""
    database = tmp_path / "db.sqlite3"
    assert write_gate(str(database)) is write_gate(str(tmp_path / "." / "db.sqlite3"))
    with write_gate(str(database)).turn(), write_gate(str(database)).turn():
        pass


def _hold_turn(database: str, holding: Any, leave: Any) -> None:
    with write_gate(database).turn():
        holding.set()
        leave.wait(PATIENCE)


def test_processes_take_turns_at_a_file_beside_the_database(tmp_path: Path) -> None:
    database = str(tmp_path / "db.sqlite3")
    holding, leave = CONTEXT.Event(), CONTEXT.Event()
    child = CONTEXT.Process(target=_hold_turn, args=(database, holding, leave), daemon=True)
    child.start()
    try:
        assert holding.wait(PATIENCE)
        _blocks_until_given_up(WriteGate(database), leave.set)
    finally:
        leave.set()
        child.join(PATIENCE)
    assert (tmp_path / f"db.sqlite3{NEXT}").exists()
    assert (tmp_path / f"db.sqlite3{TURN}").exists()


def test_a_forked_child_takes_turns_with_its_parent(tmp_path: Path) -> None:
    gate = write_gate(str(tmp_path / "db.sqlite3"))
    reader, writer = os.pipe()
    with gate.turn():
        pid = fork_beside_threads()
        if pid == 0:  # the child: its turn must wait for the parent's (files of its own)
            os.write(writer, b"w")
            with gate.turn():
                os.write(writer, b"g")
            os._exit(0)
        assert os.read(reader, 1) == b"w"
        time.sleep(0.3)
        os.set_blocking(reader, False)
        with contextlib.suppress(BlockingIOError):
            assert not os.read(reader, 1), "the child got its turn while its parent held it"
    os.set_blocking(reader, True)
    assert os.read(reader, 1) == b"g", "the child never got its turn"
    os.waitpid(pid, 0)


def _hold_turn_and_fork(database: str, by_another_thread: bool, report: Any) -> None:
    """Hold a turn (in this thread, or in another one, as a heartbeat in the middle of a
    renewal would), fork a child that sleeps, report the child's pid, and wait to be
    killed, the turn held."""
    holding, forked = threading.Event(), threading.Event()

    def hold() -> None:
        with write_gate(database).turn():
            holding.set()
            forked.wait(PATIENCE * 4)

    if by_another_thread:
        threading.Thread(target=hold, daemon=True).start()
        holding.wait(PATIENCE)
        turn: Any = contextlib.nullcontext()
    else:
        turn = write_gate(database).turn()
    with turn:
        child = fork_beside_threads()
        if child == 0:
            time.sleep(PATIENCE * 4)
            os._exit(0)
        report.put(child)
        time.sleep(PATIENCE * 4)


@pytest.mark.parametrize("by_another_thread", [False, True], ids=["forking", "other"])
def test_a_parent_killed_during_a_turn_leaves_no_turn_held_by_its_child(
    tmp_path: Path, by_another_thread: bool
) -> None:
    """A forked child (Celery's prefork pool, multiprocessing) closes the turns it
    inherited, its forking thread's and any other thread's: else a parent killed during
    a turn (SIGKILL, the OOM killer) would leave it held until the child ended."""
    database = str(tmp_path / "db.sqlite3")
    report = CONTEXT.Queue()
    parent = CONTEXT.Process(
        target=_hold_turn_and_fork, args=(database, by_another_thread, report), daemon=True
    )
    parent.start()
    child = report.get(timeout=30)  # a new worker imports this module first
    try:
        parent.kill()
        parent.join(PATIENCE)
        taken = threading.Event()

        def take() -> None:
            with write_gate(database).turn():
                taken.set()

        threading.Thread(target=take, daemon=True).start()
        assert taken.wait(PATIENCE), "the killed parent's turn is still held (by its child)"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_file_system_that_cannot_lock_means_no_turns_but_a_time_out_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gate = WriteGate(str(tmp_path / "db.sqlite3"))

    def refused(descriptor: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    with caplog.at_level(logging.WARNING, "djlocks.acquire"):
        for _ in range(2):
            with gate.turn():
                pass
    assert len([r for r in caplog.records if "take no turns" in r.getMessage()]) == 1

    def timed_out(descriptor: int, operation: int) -> None:
        raise TimeoutError("a signal's handler said the time was up")

    monkeypatch.setattr(fcntl, "flock", timed_out)
    with pytest.raises(TimeoutError), WriteGate(str(tmp_path / "other.sqlite3")).turn():
        pass


def test_a_gate_that_cannot_be_opened_warns_once_and_lets_operations_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = WriteGate(str(tmp_path / "gone" / "db.sqlite3"))  # no such directory
    with caplog.at_level(logging.WARNING, "djlocks.acquire"):
        for _ in range(2):
            with gate.turn():
                pass
    warnings = [record for record in caplog.records if "take no turns" in record.getMessage()]
    assert len(warnings) == 1


def test_an_in_memory_database_has_no_turns_and_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    in_memory = (
        "file:memorydb_default?mode=memory&cache=shared",
        "file::memory:?cache=shared",
        ":memory:",
        "",
    )
    with caplog.at_level(logging.WARNING, "djlocks.acquire"):
        for name in in_memory:
            assert database_file(name) is None
            with write_gate(name).turn():
                pass
    assert list(tmp_path.iterdir()) == []
    assert not [record for record in caplog.records if record.name == "djlocks.acquire"]
    assert database_file(f"file:{tmp_path}/db.sqlite3?mode=rwc") == str(tmp_path / "db.sqlite3")
