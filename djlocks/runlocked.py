"""Run a command while holding a lock or a semaphore slot.

For cron jobs that must never run twice at once (or more than N at once), that
must not run again within a cool-down, and that must pass signals on to their
child and clean up.

The supervisor's main thread sleeps in one ``select()`` on a self-pipe, and
everything that can happen wakes it there: a signal (through
``signal.set_wakeup_fd``, SIGCHLD included), the acquire finishing in its own
thread, the heartbeat reporting the grant lost. Nothing is polled.

The command runs in its own process group, so forwarded signals and a lost
grant's SIGTERM/SIGKILL reach everything it started (a ``sh -c`` pipeline
too). A grant that is lost, or that an operator asks back (a graceful
release), gets the command SIGTERM, then SIGKILL ``--kill-after`` seconds
later or when the holder's belief in the lease runs out, whichever is first:
the command never outlives its lease, not even when renewals fail because the
store stopped answering. On Linux it also gets SIGKILL as a parent-death signal
(``prctl(PR_SET_PDEATHSIG)``): if runlocked itself is SIGKILLed, the lease is
no longer renewed and the command must not keep running unsupervised.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from django.db import connections

from djlocks.arguments import printable
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.waiting import Abort
from djlocks.core import Lock, Semaphore
from djlocks.exceptions import BackendUnavailable, LockLost
from djlocks.grant import Grant
from djlocks.heartbeat import heartbeat
from djlocks.identity import default_label
from djlocks.leadership import RETRY_AFTER, election_name, refuse_short_holds
from djlocks.moments import moment_text

#: Exit status when the lock was not acquired (EX_TEMPFAIL); ``--conflict-exit-code`` changes it.
EXIT_CONFLICT = 75
#: Exit status when the grant was lost while the command ran (EX_PROTOCOL).
EXIT_LOST = 76
#: Exit status when the lock store could not be reached (EX_UNAVAILABLE).
EXIT_UNAVAILABLE = 69
#: Exit status when the command could not be started (as a shell reports it).
EXIT_NOT_FOUND = 127
#: Seconds of waiting after which runlocked, on a terminal, says who holds the name.
WAITING_NOTICE_AFTER = 0.2
#: Signals passed on to the command's process group.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RunLockedPlan:
    """What ``manage.py runlocked`` was asked to do; seconds throughout."""

    name: str
    command: list[str]
    limit: int = 1
    timeout: float | None = None
    ttl: float | None = None
    max_hold: float | None = None
    cooldown: float = 0.0
    backend: str = "default"
    label: str | None = None
    conflict_exit_code: int = EXIT_CONFLICT
    kill_after: float = 10.0
    verbosity: int = 1
    #: Hot standby: campaign for the leadership of ``name`` (``djlocks.leadership``), run
    #: the command while leading, and stand by again when deposed.
    standby: bool = False

    def __post_init__(self) -> None:
        if self.standby and (
            self.limit != 1 or self.timeout is not None or self.cooldown or self.max_hold
        ):
            raise ValueError(
                "--standby waits to lead for as long as it takes, one leader at a time, "
                "for as long as it lives: leave out --limit, --timeout, --nonblock, "
                "--cooldown and --max-hold."
            )
        if not self.command:
            raise ValueError("Give the command to run after --, e.g. runlocked NAME -- true.")
        for position, argument in enumerate(self.command):
            if "\x00" in argument:
                raise ValueError(
                    f"Argument {position} of the command, {argument!r}, contains "
                    f"NUL (\\x00), which no program can be given. Remove it."
                )
        if not 0 <= self.kill_after < float("inf"):
            raise ValueError(f"--kill-after must be 0 or more seconds, not {self.kill_after}.")
        if not 0 <= self.conflict_exit_code <= 255:
            raise ValueError(
                f"--conflict-exit-code must be an exit status from 0 to 255, "
                f"not {self.conflict_exit_code}."
            )

    def spec(self, on_lost: Callable[[Grant, str], None]) -> Lock:
        """Build (and so validate) the lock; renewal starts only once the command runs."""
        label = self.label
        if label is None:  # the command line, made storable: it may hold any bytes
            label = default_label(shlex.join(self.command))
        options: dict[str, Any] = {
            "timeout": self.timeout,
            "ttl": self.ttl,
            "max_hold": self.max_hold,
            "cooldown": self.cooldown,
            "backend": self.backend,
            "label": label,
            "renew": False,
            "on_lost": on_lost,
        }
        if self.standby:
            return Lock(election_name(self.name), **options)
        if self.limit == 1:
            return Lock(self.name, **options)
        return Semaphore(self.name, limit=self.limit, **options)


class _Wakeup:
    """A self-pipe the main thread sleeps on; signals and other threads write to it."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    @property
    def signal_fd(self) -> int:
        return self._write

    def poke(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the reader
            os.write(self._write, b"\0")

    def sleep(self, seconds: float | None) -> None:
        """Return when poked or signalled, or after ``seconds`` (``None``: no limit)."""
        select.select([self._read], [], [], seconds)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 512):
                pass

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class _GrantOwner(threading.Thread):
    """The thread that acquires the grant and, when asked, releases it.

    One thread does both because a row lock lives in the acquiring thread's
    database transaction; every backend is served the same way. ``answered``
    is set once ``outcome`` (a ``Grant``, ``None`` or an exception) is known.
    """

    def __init__(self, spec: Lock, abort: Abort, poke: Callable[[], None]) -> None:
        super().__init__(name="djlocks-runlocked-grant", daemon=True)
        self.spec, self.abort, self.poke = spec, abort, poke
        self.answered = threading.Event()
        self.outcome: Grant | BaseException | None = None
        self._release_now = threading.Event()
        self._released = threading.Event()
        self._release_error: BaseException | None = None

    def run(self) -> None:
        try:
            self.outcome = self.spec.acquire_grant(abort=self.abort)
        except BaseException as exc:  # handed to the main thread, which re-raises
            self.outcome = exc
        finally:
            self.answered.set()
            self.poke()
        if isinstance(self.outcome, Grant):
            self._release_now.wait()
            try:
                self.outcome.release()
            except BaseException as exc:
                self._release_error = exc
        DedicatedConnections.close_this_thread()
        connections.close_all()  # this thread's own Django connections
        self._released.set()

    def release(self) -> None:
        """Have the thread release the grant; raise what the release raised."""
        self._release_now.set()
        self._released.wait()
        if self._release_error is not None:
            raise self._release_error


def _refuse_misconfigured(spec: Lock) -> None:
    """``BackendUnavailable`` with the backend's configuration errors, its system checks
    that need no query (an unknown database, a driver it cannot use): a standby waits
    out a store it cannot reach, and would wait these out forever."""
    errors = [message for message in spec.backend.check(None) if message.is_serious()]
    if errors:
        raise BackendUnavailable(
            " ".join(f"{error.msg} {error.hint or ''}".strip() for error in errors)
        )


class Supervisor:
    """Acquire, run the command, keep the lease renewed, release; see the module docstring."""

    def __init__(self, plan: RunLockedPlan, report: TextIO) -> None:
        self.plan = plan
        self.report = report
        self.spec = plan.spec(on_lost=self._grant_lost)
        if plan.standby:
            refuse_short_holds(self.spec)
            _refuse_misconfigured(self.spec)
        self._wakeup = _Wakeup()
        self._child: subprocess.Popen[bytes] | None = None
        self._pending_signal: int | None = None  # received while no command ran
        self._lost: str | None = None
        self._owner: _GrantOwner | None = None
        self._grant: Grant | None = None  # the grant the command runs under
        self._stopped_for_loss = False  # the command got SIGTERM because the grant was lost
        self._terminating = False  # a termination signal reached runlocked: never again

    def run(self) -> int:
        """Return runlocked's exit status (see the ``EXIT_*`` constants).

        Raises ``BackendUnavailable`` when the store cannot be reached to acquire.
        """
        try:
            with self._signals_routed():
                while True:
                    try:
                        grant = self._acquire()
                    except BackendUnavailable as exc:
                        if not self._stands_by_through(exc):
                            raise
                        continue
                    if grant is None:
                        if self._pending_signal is not None:
                            return 128 + self._pending_signal
                        return self.plan.conflict_exit_code
                    status = self._run_command(grant)
                    if not self._stands_by_again():
                        return status
        finally:
            self._wakeup.close()

    def _stands_by_again(self) -> bool:
        """With ``--standby``, a deposed leader campaigns again: if its command was stopped
        because the grant was lost (not if it ended by itself) and no termination signal
        came meanwhile."""
        deposed = self._lost is not None and self._stopped_for_loss
        if not self.plan.standby or not deposed or self._terminating:
            return False
        self._say(f"standing by again for {self._what()}")
        self._lost, self._child, self._grant, self._stopped_for_loss = None, None, None, False
        return True

    def _stands_by_through(self, exc: BackendUnavailable) -> bool:
        """With ``--standby``, a store that cannot be reached is waited out (a signal
        still ends runlocked): campaign again in ``RETRY_AFTER`` seconds."""
        if not self.plan.standby or self._pending_signal is not None:
            return False
        self._say(f"the store cannot be reached ({exc}); campaigning again in {RETRY_AFTER} s")
        self._wakeup.sleep(RETRY_AFTER)
        return self._pending_signal is None

    # -- signals -------------------------------------------------------------

    @contextlib.contextmanager
    def _signals_routed(self) -> Iterator[None]:
        routed = (*FORWARDED, signal.SIGCHLD)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in routed}
        previous_fd = signal.set_wakeup_fd(self._wakeup.signal_fd, warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous_fd)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        """Runs in the main thread; the wake-up byte is already in the pipe."""
        if signum == signal.SIGCHLD:
            return
        self._terminating = True
        if self._child is None:
            self._pending_signal = signum
        else:
            self._signal_group(signum)

    def _signal_group(self, signum: int) -> None:
        # Only the main thread reaps the command, and it does so after its last
        # signal, so the group id cannot have been reused by another process.
        assert self._child is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._child.pid, signum)

    def _grant_lost(self, grant: Grant, reason: str) -> None:
        """Called by the heartbeat thread; a late call about an earlier term's grant is
        ignored."""
        if grant is not self._grant:
            return
        self._lost = reason
        self._wakeup.poke()

    # -- acquire -------------------------------------------------------------

    def _acquire(self) -> Grant | None:
        """Acquire in the grant's own thread, so that a signal can abort the wait cleanly.

        An aborted wait leaves nothing behind: no grant, waiter record or renewal."""
        abort = Abort()
        self._owner = _GrantOwner(self.spec, abort, self._wakeup.poke)
        self._owner.start()
        notice_at = time.monotonic() + WAITING_NOTICE_AFTER if self._chatty() else None
        while not self._owner.answered.is_set():
            self._wakeup.sleep(None if notice_at is None else notice_at - time.monotonic())
            answered = self._owner.answered.is_set()
            if notice_at is not None and not answered and time.monotonic() >= notice_at:
                self._say(f"waiting for {self._what()}, held by {self._holders()}")
                notice_at = None
            if self._pending_signal is not None:
                abort.set()
        result = self._owner.outcome
        if isinstance(result, BaseException):
            raise result
        if result is not None and self._pending_signal is not None:
            self._release(result)  # a termination signal came first: never start
            return None
        if result is None and self._pending_signal is None:
            self._say_not_acquired()
        return result

    # -- the command ---------------------------------------------------------

    def _run_command(self, grant: Grant) -> int:
        self._grant = grant
        if grant.lost_reason is not None:  # lost before this term's watch began
            self._lost = grant.lost_reason
        if self._pending_signal is not None:
            self._release(grant)
            return 128 + self._pending_signal
        if self.plan.verbosity >= 2:
            self._say(f"acquired {self._what()}: slot {grant.slot}, fence {grant.fence}")
        environment = {
            **os.environ,
            "DJLOCKS_NAME": self.plan.name,
            "DJLOCKS_SLOT": str(grant.slot),
            "DJLOCKS_FENCE": str(grant.fence),
        }
        if self.plan.standby:
            environment["DJLOCKS_TERM"] = str(grant.fence)
        try:
            self._child = subprocess.Popen(
                self.plan.command,
                env=environment,
                process_group=0,
                preexec_fn=_dies_with_parent(os.getpid()),
            )
        except OSError as exc:
            self._say(f"cannot run {printable(shlex.join(self.plan.command))}: {exc}")
            self._release(grant)
            return EXIT_NOT_FOUND
        if self._pending_signal is not None:  # arrived while the command was being started
            self._signal_group(self._pending_signal)
        heartbeat.add(grant)
        status = self._wait_for_command(grant)
        self._release(grant)
        if self._lost is not None:
            self._say(f"lost {self._what()} while the command ran: {self._lost}")
            return EXIT_LOST
        if self.plan.verbosity >= 2:
            self._say(f"released {self._what()}; the command exited with status {status}")
        return status

    def _wait_for_command(self, grant: Grant) -> int:
        """Wait for the command; if the grant is lost (or asked back), SIGTERM its group,
        then SIGKILL ``--kill-after`` seconds later, or when the holder's belief in the
        lease runs out (``grant.believe_until()``), whichever comes first: the command
        never runs past the moment its lease could end.

        The belief's end is watched here too, not only by the heartbeat, whose
        renewal may hang on a store that stopped answering.
        """
        assert self._child is not None
        terminated_at: float | None = None
        killed = False
        while (returncode := self._child.poll()) is None:
            self._wakeup.sleep(self._next_deadline(grant, terminated_at, killed))
            now = time.monotonic()
            if self._lost is None and now >= grant.believe_until():
                self._lost = grant.ran_out_reason()
            if self._lost is not None and terminated_at is None:
                self._say(f"lost {self._what()} ({self._lost}): terminating the command")
                self._signal_group(signal.SIGTERM)
                terminated_at = now
                self._stopped_for_loss = True
            if terminated_at is not None and not killed:
                killed = self._kill_if_due(grant, terminated_at, now)
        return returncode if returncode >= 0 else 128 - returncode

    def _next_deadline(
        self, grant: Grant, terminated_at: float | None, killed: bool
    ) -> float | None:
        """Seconds until the supervisor must act unasked, or ``None`` (only a wake-up)."""
        if killed:
            return None
        due = (
            grant.believe_until() if terminated_at is None else self._kill_at(grant, terminated_at)
        )
        return max(0.0, due - time.monotonic())

    def _kill_at(self, grant: Grant, terminated_at: float) -> float:
        """When a command SIGTERMed at ``terminated_at`` gets SIGKILL (monotonic)."""
        return min(terminated_at + self.plan.kill_after, grant.believe_until())

    def _kill_if_due(self, grant: Grant, terminated_at: float, now: float) -> bool:
        """SIGKILL the command's group if its time came; True if it did."""
        if now < self._kill_at(grant, terminated_at):
            return False
        outlived = now - terminated_at
        if terminated_at + self.plan.kill_after <= grant.believe_until():
            self._say(f"the command outlived SIGTERM by {self.plan.kill_after} s: SIGKILL")
        else:
            self._say(
                f"the command outlived SIGTERM by {outlived:.1f} s and its lease may end now "
                f"(--kill-after {self.plan.kill_after} s never runs past the lease): SIGKILL"
            )
        self._signal_group(signal.SIGKILL)
        return True

    def _release(self, grant: Grant) -> None:
        assert self._owner is not None
        try:
            self._owner.release()
        except LockLost as exc:
            self._lost = self._lost or str(exc)
        except BackendUnavailable as exc:
            self._say(f"could not release {self._what()} ({exc}); its lease ends at its TTL")

    # -- messages ------------------------------------------------------------

    def _what(self) -> str:
        if self.plan.standby:
            return f"the leadership of {self.plan.name!r}"
        if self.plan.limit == 1:
            return f"lock {self.plan.name!r}"
        return f"a slot of {self.plan.name!r} (limit {self.plan.limit})"

    def _holders(self) -> str:
        holders = self.spec.backend.holders(self.spec.name)
        if not holders:
            return "nobody (it is in a cool-down or others wait ahead)"
        return "; ".join(
            printable(f"{h.host} pid {h.pid} since {moment_text(h.since)} ({h.label})")
            for h in holders
        )

    def _chatty(self) -> bool:
        """Say what runlocked waits for on a terminal, or always at verbosity 2 and up."""
        return self.plan.verbosity >= 2 or (self.plan.verbosity >= 1 and self.report.isatty())

    def _say_not_acquired(self) -> None:
        if self._chatty():
            self._say(
                f"{self._what()} was not acquired within {self.plan.timeout or 0} s; "
                f"held by {self._holders()}"
            )

    def _say(self, message: str) -> None:
        if self.plan.verbosity >= 1:
            self.report.write(f"runlocked: {message}\n")
            self.report.flush()


def _dies_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the command when runlocked dies.

    Resolved before ``fork()``; runs in the child with only the forking
    thread alive (runlocked starts the heartbeat only after the command).
    Elsewhere there is no such request, and a SIGKILLed runlocked leaves its
    command running: that is documented.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # runlocked died before the request took effect
            os._exit(EXIT_LOST)

    return die_with_parent
