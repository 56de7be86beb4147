"""``manage.py runlocked``: its supervision of the command and the issue's behaviours,
with real processes (runlocked, its command and, where needed, another holder)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from djlocks import Lock
from djlocks.backends import backends
from djlocks.inspection import force_release
from djlocks.leadership import election_name
from djlocks.runlocked import EXIT_CONFLICT, EXIT_LOST
from djlocks.stress import StressPlan, run_stress
from tests.processes import alive, finished, manage, runlocked, wait_for_file, wait_until_dead

pytestmark = pytest.mark.usefixtures("store")


@pytest.fixture
def held() -> Iterator[Lock]:
    """The lock 'job' held by this test process while the test runs."""
    lock = Lock("job", ttl=30)
    assert lock.acquire(timeout=0)
    yield lock
    lock.release()


@pytest.mark.catalogue("runlocked-supervision", backend="default")
def test_conflict_exits_75_or_the_chosen_status(held: Lock) -> None:
    assert finished(runlocked("job", "-n", "--", "true")) == EXIT_CONFLICT == 75
    assert finished(runlocked("job", "-n", "--conflict-exit-code", "9", "--", "true")) == 9
    began = time.monotonic()
    assert finished(runlocked("job", "--timeout", "0.5", "--", "true")) == EXIT_CONFLICT
    assert time.monotonic() - began >= 0.5


@pytest.mark.catalogue("runlocked-supervision", backend="default")
def test_the_commands_exit_status_is_passed_through() -> None:
    assert finished(runlocked("job", "--", "sh", "-c", "exit 7")) == 7
    assert finished(runlocked("job", "--", "sh", "-c", "kill -KILL $$")) == 128 + 9
    assert finished(runlocked("job", "--", "no-such-program-anywhere")) == 127
    assert backends["default"].holders("job") == []


def test_the_command_gets_the_grant_in_its_environment(tmp_path: Path) -> None:
    out = tmp_path / "grant"
    script = f'echo "$DJLOCKS_NAME $DJLOCKS_SLOT $DJLOCKS_FENCE" > {out}'
    assert finished(runlocked("job", "--", "sh", "-c", script)) == 0
    name, slot, fence = out.read_text().split()
    assert (name, slot) == ("job", "0") and int(fence) >= 1


@pytest.mark.catalogue("runlocked-supervision", backend="default")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_reach_the_whole_group_of_a_sh_command(tmp_path: Path, signum: int) -> None:
    shell_pid, background_pid = tmp_path / "shell", tmp_path / "background"
    # A background child of sh, which a signal sent to sh alone would not reach.
    # It restores SIGINT's default first: sh makes background jobs ignore SIGINT.
    background = (
        "import os, signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"open({str(background_pid)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    )
    script = f'python3 -c "{background}" & echo $$ > {shell_pid}; wait'
    wrapper = runlocked("job", "--", "sh", "-c", script)
    shell, child = int(wait_for_file(shell_pid)), int(wait_for_file(background_pid))
    wrapper.send_signal(signum)
    assert finished(wrapper) == 128 + signum
    wait_until_dead(child, timeout=5)
    assert not alive(shell)
    assert backends["default"].holders("job") == [], "runlocked must release after the command"


@pytest.mark.catalogue("runlocked-supervision", backend="default")
def test_a_signal_while_waiting_means_the_command_never_starts(tmp_path: Path, held: Lock) -> None:
    marker = tmp_path / "started"
    wrapper = runlocked("job", "-v", "2", "--", "touch", str(marker), stderr=subprocess.PIPE)
    assert wrapper.stderr is not None
    assert "waiting for lock 'job', held by" in wrapper.stderr.readline()
    wrapper.send_signal(signal.SIGTERM)
    assert finished(wrapper) == 128 + signal.SIGTERM
    wrapper.stderr.close()
    assert not marker.exists()
    assert backends["default"].waiters("job") == []


@pytest.mark.catalogue("runlocked-supervision", backend="default")
def test_sigkill_of_runlocked_kills_its_command_and_the_lease_frees(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    wrapper = runlocked(
        "job", "--ttl", "1", "--", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"
    )
    command = int(wait_for_file(pid_file))
    wrapper.kill()
    assert finished(wrapper) == -signal.SIGKILL
    wait_until_dead(command, timeout=2)  # the parent-death signal
    began = time.monotonic()
    lock = Lock("job", ttl=5)
    assert lock.acquire(timeout=10), "the lease of a killed runlocked must expire at its TTL"
    assert time.monotonic() - began < 1 + 3  # its TTL, and slack for a loaded box
    lock.release()


@pytest.mark.catalogue("runlocked-supervision", backend="default")
def test_forced_release_terminates_the_group_escalating_to_sigkill(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    stubborn = f"trap '' TERM; echo $$ > {pid_file}; while :; do sleep 0.05; done"
    wrapper = runlocked("job", "--ttl", "1.5", "--kill-after", "0.5", "--", "sh", "-c", stubborn)
    command = int(wait_for_file(pid_file))
    release = manage("djlocks", "release", "job", "--yes", "--reason", "t", stdout=subprocess.PIPE)
    output, _ = release.communicate(timeout=30)
    assert release.returncode == 0 and "Released 1 grant" in output
    began = time.monotonic()
    assert finished(wrapper) == EXIT_LOST == 76
    # Noticed at the next renewal (every TTL/3), then SIGTERM, ignored, then SIGKILL.
    assert time.monotonic() - began < 0.5 + 0.5 + 1
    wait_until_dead(command, timeout=1)


@pytest.mark.catalogue("runlocked-supervision", backend="default")
def test_a_pause_past_the_lease_loses_it_and_stops_the_command(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    wrapper = runlocked(
        "job", "--ttl", "0.6", "--", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"
    )
    command = int(wait_for_file(pid_file))
    wrapper.send_signal(signal.SIGSTOP)
    other = Lock("job", ttl=5)
    assert other.acquire(timeout=5), "the paused holder's lease must expire"
    wrapper.send_signal(signal.SIGCONT)
    assert finished(wrapper) == EXIT_LOST
    wait_until_dead(command, timeout=1)
    other.release()


def test_cooldown_keeps_the_name_unavailable_after_the_command() -> None:
    """A cool-down long enough to outlast a loaded machine's start of the next process."""
    assert finished(runlocked("job", "--cooldown", "5", "--", "sh", "-c", "exit 3")) == 3
    assert [c.name for c in backends["default"].cooldowns()] == ["job"]
    assert finished(runlocked("job", "-n", "--", "true")) == EXIT_CONFLICT
    deadline = time.monotonic() + 10
    while backends["default"].cooldowns():
        assert time.monotonic() < deadline, "the cool-down outlived its 5 s"
        time.sleep(0.1)
    assert finished(runlocked("job", "-n", "--", "true")) == 0


@pytest.mark.parametrize(
    "arguments",
    [
        ["job", "true"],  # no --
        ["job", "--"],  # no command
        ["--", "true"],  # no name
        ["job", "--backend", "nowhere", "--", "true"],
        ["job", "--limit", "0", "--", "true"],
        ["job", "--limit", "20000", "--", "true"],  # above the lease backend's most
        ["job", "--timeout", "-1", "--", "true"],
        ["", "--", "true"],
        ["job", "--kill-after", "-1", "--", "true"],
    ],
)
def test_bad_usage_exits_2_with_a_message(arguments: list[str]) -> None:
    wrapper = runlocked(*arguments, stderr=subprocess.PIPE)
    _, error = wrapper.communicate(timeout=30)
    assert wrapper.returncode == 2
    assert error.strip(), "say what was wrong"


@pytest.mark.strength
@pytest.mark.one_database
def test_runlocked_lock_strength_test_with_8_processes() -> None:
    plan = StressPlan("default", processes=8, iterations=4, via="runlocked")
    result = run_stress(plan, timeout=240)
    assert result.ok, result
    assert result.counter == 32


@pytest.mark.strength
@pytest.mark.one_database
def test_runlocked_limit_3_with_8_processes_reaches_3_never_more() -> None:
    # Each run starts a Django process (about a second on a loaded 2-core
    # machine); holds of 0-1.2 s make three at once certain, not lucky.
    plan = StressPlan("default", processes=8, iterations=4, limit=3, hold_ms=600, via="runlocked")
    result = run_stress(plan, timeout=240)
    assert result.ok, result
    assert result.max_concurrent == 3


def test_a_command_held_past_max_hold_is_stopped_and_the_name_freed(tmp_path: Path) -> None:
    """``--max-hold``: the command is stopped as for a lost lock, and the next holder
    gets the name at once, not at the end of the 30 s lease."""
    started = tmp_path / "started"
    began = time.monotonic()
    wrapper = runlocked(
        "test:max-hold", "--ttl", "30", "--max-hold", "1", "--kill-after", "1",
        "--", "sh", "-c", f"echo running > {started}; exec sleep 300",
    )  # fmt: skip
    wait_for_file(started)
    assert wrapper.wait(20) == EXIT_LOST
    assert time.monotonic() - began < 15
    with Lock("test:max-hold", timeout=5):
        pass


def test_max_hold_that_is_not_a_length_of_time_is_a_usage_error() -> None:
    assert finished(runlocked("test:max-hold", "--max-hold", "0", "--", "true")) == 2


def test_a_cooldown_on_a_backend_that_cannot_hold_a_slot_back_is_a_usage_error() -> None:
    """The row backend's lock ends with its transaction: one line and status 2, not the
    traceback of the first acquire."""
    process = runlocked(
        "test:cooldown", "--backend", "row", "--cooldown", "5", "--", "true", stderr=subprocess.PIPE
    )
    _, said = process.communicate(timeout=30)
    assert process.returncode == 2
    assert "--cooldown needs a backend" in said and "Traceback" not in said


def _terms(path: Path, count: int, timeout: float = 20) -> list[int]:
    """The terms the commands appended to ``path``, once there are ``count`` of them."""
    deadline = time.monotonic() + timeout
    while len(terms := [int(t) for t in path.read_text().split()] if path.exists() else []) < count:
        assert time.monotonic() < deadline, f"{path} has {terms}, not {count} terms"
        time.sleep(0.02)
    return terms


@pytest.mark.catalogue("runlocked-supervision", backend="default")
def test_standby_runs_the_command_on_one_leader_and_takes_over_with_a_higher_term(
    tmp_path: Path,
) -> None:
    """Two hot standbys: one leads; when it stops the other's command starts, with a
    higher term; a deposed leader stops its command and leads again once free."""
    terms = tmp_path / "terms"
    script = f'echo "$DJLOCKS_TERM" >> {terms}; exec sleep 300'
    first = runlocked("beat", "--standby", "--ttl", "3", "--", "sh", "-c", script)
    (first_term,) = _terms(terms, 1)
    second = runlocked("beat", "--standby", "--ttl", "3", "--", "sh", "-c", script)
    try:
        time.sleep(1.0)
        assert _terms(terms, 1) == [first_term], "a standby ran its command"
        first.send_signal(signal.SIGTERM)
        assert finished(first) == 128 + signal.SIGTERM
        second_term = _terms(terms, 2)[1]
        assert second_term > first_term
        (leader,) = backends["default"].holders(election_name("beat"))
        force_release([leader], reason="runlocked standby test")
        third_term = _terms(terms, 3)[2]  # deposed, stood by, and led again: nobody else
        assert third_term > second_term and second.poll() is None
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                finished(process)
    assert backends["default"].holders(election_name("beat")) == []


def test_standby_refuses_options_that_make_no_sense_for_a_leader() -> None:
    for extra in (
        ["--limit", "2"],
        ["-n"],
        ["--timeout", "5"],
        ["--cooldown", "9"],
        ["--max-hold", "9"],
    ):
        process = runlocked("beat", "--standby", *extra, "--", "true", stderr=subprocess.PIPE)
        _, said = process.communicate(timeout=30)
        assert process.returncode == 2 and "--standby" in said
