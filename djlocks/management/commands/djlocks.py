"""``manage.py djlocks list|show|release|key|sweep|stress``: inspect, force, find, clean, test."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from argparse import SUPPRESS, ArgumentParser
from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, OutputWrapper
from django.db import DatabaseError

from djlocks import Lock
from djlocks.arguments import normalize_idle_names, printable, validate_name, validate_text
from djlocks.backends import backends
from djlocks.backends.base import HolderInfo
from djlocks.conf import djlocks_settings
from djlocks.events import events
from djlocks.exceptions import BackendUnavailable
from djlocks.inspection import (
    GRACEFUL_WAIT,
    UNUSABLE,
    Snapshot,
    force_release,
    request_release,
    snapshot,
    unusable,
)
from djlocks.keys import GATE, table_key
from djlocks.metrics import exposition
from djlocks.moments import MomentEncoder, moment_text
from djlocks.runlocked import EXIT_UNAVAILABLE
from djlocks.stress import MODES as STRESS_MODES
from djlocks.stress import MULTI_NAMES, MULTI_SET, StressPlan, run_stress

USAGE_ERROR = 2
#: The lock a periodic sweep (``sweep --every``) holds while it sweeps.
SWEEP_LOCK = "djlocks:sweep"
#: Seconds between looks at the store while a graceful release waits for the holders.
GRACEFUL_POLL = 0.1
#: Options every management command takes; accepted after the subcommand too.
DJANGO_FLAGS = ("--traceback", "--no-color", "--force-color", "--skip-checks")
DJANGO_VALUES = ("--settings", "--pythonpath")


class Command(BaseCommand):
    """``djlocks list|show|release|key|sweep|stress``; see ``help``.

    Exit status: 0; 2 for bad usage (a name that is empty, longer than 255
    characters, or holds NUL or bytes that were not UTF-8; an unknown backend);
    69 (EX_UNAVAILABLE) from ``list`` and ``show`` when a store could not be
    asked, after printing what the reachable stores hold, and from ``release``
    when a store failed part-way (the grants released before it are recorded,
    and their number printed); 1 for other failures.
    Names, labels, hosts and threads are printed with control characters
    escaped (``\\x1b``, ``\\n``), so none can drive the terminal; ``--json``
    escapes them as JSON does.
    """

    help = (
        "Inspect djlocks' locks and semaphores, release them by force, print a name's server "
        "lock key, sweep, stress-test. "
        f"Exit status: {USAGE_ERROR} for bad usage; {EXIT_UNAVAILABLE} when a database or "
        "store could not be used (list and show still show the reachable ones; release "
        "says how far it got)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        subcommands = parser.add_subparsers(dest="subcommand", required=True)
        listing = subcommands.add_parser(
            "list", help="Every name with its holders, waiters and cool-downs."
        )
        showing = subcommands.add_parser("show", help="One name in detail.")
        showing.add_argument("name")
        for inspecting in (listing, showing):
            inspecting.add_argument("--backend", default=None, help="Only this backend alias.")
            inspecting.add_argument(
                "--json", action="store_true", dest="as_json", help="One JSON document."
            )

        releasing = subcommands.add_parser(
            "release",
            help="Take a name's grants away by force; each holder learns LockLost, and the "
            "next waiter may start while the old holder still runs. With --graceful, ask "
            "the holders to give them back instead.",
        )
        releasing.add_argument("name")
        releasing.add_argument("--backend", default=None, help="Only this backend alias.")
        releasing.add_argument(
            "--holder",
            type=int,
            default=None,
            metavar="FENCE",
            help="Only the grant with this fence (as `list` shows it); default: every holder.",
        )
        releasing.add_argument("--reason", default="", help="Recorded with the release.")
        releasing.add_argument("--yes", action="store_true", help="Do not ask for confirmation.")
        releasing.add_argument(
            "--graceful",
            action="store_true",
            help="Ask each holder to stop and give its grant back (a runlocked holder stops "
            "its command); the slot stays held until it has, or until --wait runs out, so "
            "the next waiter never starts while the old holder still runs. Waits for that.",
        )
        releasing.add_argument(
            "--wait",
            type=float,
            default=None,
            metavar="S",
            help=f"With --graceful: seconds the holders get (default {GRACEFUL_WAIT:g}); the "
            f"store ends their leases then.",
        )

        keying = subcommands.add_parser(
            "key", help="The key a name has in the store, for scripts using mysql or psql."
        )
        keying.add_argument("name")
        keying.add_argument("--backend", default="default")
        keying.add_argument(
            "--slot", default=None, help="A semaphore's slot number, or 'gate' for its waiters."
        )

        sweeping = subcommands.add_parser(
            "sweep",
            help="Remove expired grants, dead waiters, old history and (with --idle-names "
            "or SWEEP_IDLE_NAMES) idle names; safe to run from cron.",
        )
        sweeping.add_argument(
            "--idle-names",
            type=float,
            default=None,
            metavar="S",
            help="Also remove each name nothing holds, waits for or cools down on that was "
            "last granted more than S seconds ago (at least 120; default: the setting "
            "SWEEP_IDLE_NAMES, else keep every name).",
        )
        sweeping.add_argument(
            "--every",
            type=float,
            default=None,
            metavar="S",
            help="Sweep again every S seconds until stopped (SIGTERM, Ctrl-C), for a "
            "service or a container beside the app. Each sweep holds the lock "
            f"{SWEEP_LOCK!r} on the default backend: one process sweeps at a time.",
        )
        subcommands.add_parser(
            "metrics",
            help="The Prometheus metrics in the text format: every process's where "
            "PROMETHEUS_MULTIPROC_DIR is set, else this command's own (the [prometheus] extra).",
        )

        stress = subcommands.add_parser(
            "stress",
            help="The strength test: processes increment a counter under the lock; "
            "any lost update or overlap proves two holders.",
        )
        stress.add_argument("--backend", default="default")
        stress.add_argument("--processes", type=int, default=8)
        stress.add_argument("--iterations", type=int, default=200)
        stress.add_argument("--limit", type=int, default=1)
        stress.add_argument("--hold-ms", type=float, default=0.0)
        stress.add_argument("--ttl", type=float, default=30.0)
        stress.add_argument("--timeout", type=float, default=600.0, help="Seconds for the run.")
        stress.add_argument(
            "--mode",
            choices=list(STRESS_MODES),
            default="lock",
            help="lock: one name (a semaphore with --limit); multi: each iteration takes "
            f"{MULTI_SET} of {MULTI_NAMES} names together (db_locks); leader: each "
            f"iteration wins the leadership of NAME (djlocks.leadership), increments as "
            f"the leader with its term as the fence, and steps down; rw: each iteration "
            f"reads or, one time in four, writes (db_rwlock).",
        )
        stress.add_argument(
            "--via",
            choices=["api", "runlocked"],
            default="api",
            help="runlocked: each increment is a `manage.py runlocked NAME -- program` run.",
        )
        stress.add_argument(
            "--json", action="store_true", dest="as_json", help="End with one JSON line."
        )
        for subcommand in subcommands.choices.values():
            _accept_django_options(subcommand)

    def execute(self, *args: Any, **options: Any) -> str | None:
        """Django's ``execute``: the system checks, then ``handle``. Django's own checks may
        read the database first (MySQL's server version, under Django 6): a database
        that is down then ends the command as ``handle`` ends it, with exit status 69
        and one line, not a traceback."""
        try:
            return super().execute(*args, **options)
        except DatabaseError as exc:
            raise CommandError(
                f"djlocks: the database could not be used while Django ran its system "
                f"checks: {exc}",
                returncode=EXIT_UNAVAILABLE,
            ) from exc

    def handle(self, *args: Any, subcommand: str, **options: Any) -> None:
        try:
            if options.get("backend"):
                backends[options["backend"]]  # an unknown alias fails here, listing the known
            if "name" in options:
                validate_name(options["name"])
            if "reason" in options:
                validate_text(options["reason"], "--reason")
            getattr(self, subcommand)(**options)
        except (ImproperlyConfigured, ValueError) as exc:
            raise CommandError(str(exc), returncode=USAGE_ERROR) from exc
        except (BackendUnavailable, DatabaseError) as exc:  # a store or the history's database
            raise CommandError(
                f"djlocks {subcommand}: a database or store could not be used: {exc}",
                returncode=EXIT_UNAVAILABLE,
            ) from exc

    # -- list and show -------------------------------------------------------

    def metrics(self, **unused: Any) -> None:
        body, _ = exposition()
        self.stdout.write(body.decode(), ending="")

    def list(self, *, backend: str | None, as_json: bool, **unused: Any) -> None:
        self._print(snapshot(backend=backend), as_json, nothing="No holders and no waiters.")

    def show(self, *, name: str, backend: str | None, as_json: bool, **unused: Any) -> None:
        self._print(
            snapshot(name, backend),
            as_json,
            nothing=f"{name!r} is free: no holder, no waiter, no cool-down.",
        )

    def _print(self, found: Snapshot, as_json: bool, *, nothing: str) -> None:
        """Print ``found``; raise ``CommandError`` (exit 69) if a store could not be asked."""
        for alias, reason in found.unavailable.items():
            self._say(f"backend {alias!r} could not be asked: {reason}", self.stderr)
        if as_json:
            self.stdout.write(json.dumps(found.as_json(), cls=MomentEncoder))
        else:
            self._print_lines(found, nothing)
        if found.unavailable:
            raise CommandError(
                f"{len(found.unavailable)} store(s) could not be asked; the others are shown.",
                returncode=EXIT_UNAVAILABLE,
            )

    def _print_lines(self, found: Snapshot, nothing: str) -> None:
        for h in found.holders:
            expiry = (
                f"with {backends[h.backend].capabilities.grant_ends_with}"
                if h.expires_at is None
                else moment_text(h.expires_at, "%H:%M:%S")
            )
            connection = "" if h.connection_id is None else f"  connection {h.connection_id}"
            self._say(
                f"{h.backend}  {h.name}  slot {h.slot}/{h.limit}  fence {_fence(h)}  "
                f"{h.host}:{h.pid} {h.thread}  since {moment_text(h.since)}  "
                f"expires {expiry}{connection}  {h.label}"
                + ("" if h.recorded else "  (server's view: record not written yet)")
            )
        for w in found.waiters:
            self._say(
                f"{w.backend}  {w.name}  waiter #{w.position}  {w.host}:{w.pid} {w.thread}  "
                f"since {moment_text(w.since)}  {w.label}"
            )
        for c in found.cooldowns:
            until = moment_text(c.until, "%H:%M:%S")
            self._say(f"{c.backend}  {c.name}  slot {c.slot}  cool-down until {until}")
        if found.empty and not found.unavailable:
            self._say(nothing)

    def _say(self, line: str, stream: OutputWrapper | None = None) -> None:
        """Write ``line`` with its control characters escaped: names, labels, hosts and
        threads are anyone's text, and must not drive the operator's terminal."""
        (stream or self.stdout).write(printable(line))

    # -- release -------------------------------------------------------------

    def release(
        self,
        *,
        name: str,
        backend: str | None,
        holder: int | None,
        reason: str,
        yes: bool,
        graceful: bool,
        wait: float | None,
        **unused: Any,
    ) -> None:
        if wait is not None and not graceful:
            raise CommandError(
                "--wait is the time a graceful release gives the holders: add --graceful.",
                returncode=USAGE_ERROR,
            )
        holders = snapshot(name, backend).holders
        if holder is not None:
            holders = [h for h in holders if h.fence == holder]
        if not holders:
            which = f"with fence {holder}" if holder is not None else "at all"
            raise CommandError(f"Nobody holds {name!r} {which}; nothing to release.")
        for h in holders:
            self._say(
                f"{h.backend}  {h.name}  slot {h.slot}  fence {_fence(h)}  "
                f"held by {h.host}:{h.pid} since {moment_text(h.since)}  {h.label}"
            )
        if graceful:
            self._release_gracefully(
                name, holders, reason, yes, GRACEFUL_WAIT if wait is None else wait
            )
            return
        if not yes:
            self._confirm(f"Release these {len(holders)} grant(s) by force?")
        released: list[HolderInfo] = []
        try:
            force_release(holders, reason=reason, on_released=released.append)
        except BackendUnavailable as exc:
            raise CommandError(
                f"Released {len(released)} of {len(holders)} grant(s) of {name!r} (each one "
                f"recorded), then a store failed: {exc}",
                returncode=EXIT_UNAVAILABLE,
            ) from exc
        self.stdout.write(
            f"Released {len(released)} grant(s) of {name!r}; each holder hears of it at once "
            f"where the store can push, else at its next renewal or check, and gets LockLost; "
            f"a runlocked holder stops its command. The next waiter may start meanwhile "
            f"(--graceful waits for the holders instead)."
        )

    def _release_gracefully(
        self, name: str, holders: Sequence[HolderInfo], reason: str, yes: bool, wait: float
    ) -> None:
        """Ask ``holders`` for their grants back, then wait until every grant ended."""
        if not 0 < wait < float("inf"):
            raise CommandError(f"--wait must be more than 0 seconds, not {wait}.", USAGE_ERROR)
        if not yes:
            self._confirm(
                f"Ask the holders of these {len(holders)} grant(s) to release within {wait:g} s?"
            )
        asked: list[HolderInfo] = []
        began = time.monotonic()
        try:
            request_release([*holders], wait=wait, reason=reason, on_requested=asked.append)
        except BackendUnavailable as exc:
            raise CommandError(
                f"Asked {len(asked)} of {len(holders)} holder(s) of {name!r} (each one "
                f"recorded), then a store failed: {exc}",
                returncode=EXIT_UNAVAILABLE,
            ) from exc
        self.stdout.write(
            f"Asked {len(asked)} holder(s) of {name!r} to release within {wait:g} s. Each slot "
            f"stays held until its holder releases it or the wait ends, so the next waiter "
            f"does not start before; waiting for that ..."
        )
        left = self._wait_for_the_end(name, asked, began + wait + 1)
        if left:
            raise CommandError(f"{len(left)} grant(s) of {name!r} are still held.")
        self.stdout.write(
            f"Done after {time.monotonic() - began:.1f} s: every grant asked for has ended "
            f"(released by its holder, or at the end of the wait)."
        )

    def _wait_for_the_end(
        self, name: str, grants: Sequence[HolderInfo], deadline: float
    ) -> Sequence[HolderInfo]:
        """Wait until none of ``grants`` of ``name`` is held, or until ``deadline``
        (monotonic); return those still held. Raises ``CommandError`` (exit 69) if a
        store can no longer be asked."""
        held = grants
        while held and time.monotonic() < deadline:
            time.sleep(GRACEFUL_POLL)
            live = set()
            for alias in {g.backend for g in held}:
                found = snapshot(name, alias)
                if found.unavailable:
                    raise CommandError(
                        f"Could not see whether the holders released: {found.unavailable[alias]}",
                        returncode=EXIT_UNAVAILABLE,
                    )
                live |= {(h.backend, h.fence) for h in found.holders}
            held = [g for g in held if (g.backend, g.fence) in live]
        return held

    def _confirm(self, question: str) -> None:
        if not sys.stdin.isatty():
            raise CommandError(
                "Not asking for confirmation without a terminal: add --yes to release.",
                returncode=USAGE_ERROR,
            )
        try:
            answer = input(f"{question} [y/N] ")
        except EOFError:  # Ctrl-D: no
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            raise CommandError("Nothing released.")

    # -- key -----------------------------------------------------------------

    def key(self, *, name: str, backend: str, slot: str | None, **unused: Any) -> None:
        key = backends[backend].key(name, _slot(slot))
        if key is None:
            raise CommandError(
                f"Backend {backend!r} keeps names in table rows under name_key = "
                f"{table_key(name)} (the SHA-256 of the name); only session backends "
                f"have server lock keys.",
                returncode=USAGE_ERROR,
            )
        self.stdout.write(str(key))

    # -- sweep ---------------------------------------------------------------

    def sweep(self, *, idle_names: float | None, every: float | None, **unused: Any) -> None:
        try:
            idle = normalize_idle_names(
                djlocks_settings()["SWEEP_IDLE_NAMES"] if idle_names is None else idle_names
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(f"--idle-names: {exc}", returncode=USAGE_ERROR) from exc
        if every is None:
            self._sweep_once(idle, again=False)
            return
        if not every > 0:
            raise CommandError("--every must be more than 0 seconds.", returncode=USAGE_ERROR)
        # SIGTERM (a service manager) or Ctrl-C ends the loop between sweeps: one under
        # way finishes and releases its lock, so the next process need not wait for it.
        stopping = threading.Event()
        for stop in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop, lambda signum, frame: stopping.set())
        lock = Lock(SWEEP_LOCK, label="djlocks sweep --every")
        while not stopping.is_set():
            if lock.acquire(timeout=0):
                try:
                    self._sweep_once(idle, again=True)
                finally:
                    lock.release()
            stopping.wait(every)

    def _sweep_once(self, idle: float | None, *, again: bool) -> None:
        """Sweep every backend; one that cannot be asked is named, and the others swept
        (exit 69 at the end, unless the sweep goes on ``again``)."""
        failed = []
        for alias in backends.aliases():
            try:
                store = backends[alias]
                removed = store.sweep() if idle is None else store.sweep(idle_names=idle)
            except UNUSABLE as exc:
                failed.append(alias)
                self._say(f"{alias}: not swept: {unusable(alias, exc)}", self.stderr)
                continue
            summary = ", ".join(f"{count} {kind}" for kind, count in removed.items())
            self.stdout.write(f"{alias}: {summary or 'nothing to sweep'}")
        self.stdout.write(f"history: {events.sweep()} event(s) past the retention deleted")
        if failed and not again:
            raise CommandError(
                f"{len(failed)} store(s) could not be swept; the others were.",
                returncode=EXIT_UNAVAILABLE,
            )

    # -- stress --------------------------------------------------------------

    def stress(
        self,
        *,
        backend: str,
        processes: int,
        iterations: int,
        limit: int,
        hold_ms: float,
        ttl: float,
        timeout: float,
        via: str,
        mode: str,
        as_json: bool,
        **unused: Any,
    ) -> None:
        if processes < 1 or iterations < 1 or limit < 1:
            raise CommandError(
                "--processes, --iterations and --limit must be at least 1.",
                returncode=USAGE_ERROR,
            )
        plan = StressPlan(backend, processes, iterations, limit, hold_ms, ttl, via=via, mode=mode)
        kind = "lock" if limit == 1 else f"semaphore (limit {limit})"
        if mode == "multi":
            kind = f"{MULTI_SET} of {MULTI_NAMES} names at once (db_locks)"
        if mode == "leader":
            kind = "leadership (djlocks.leadership)"
        if mode == "rw":
            kind = "reader-writer lock (db_rwlock)"
        through = " through runlocked" if via == "runlocked" else ""
        self.stdout.write(
            f"Strength test of a {kind}{through} on backend {backend!r}: "
            f"{processes} processes x {iterations} iterations ..."
        )
        result = run_stress(plan, timeout=timeout)
        self.stdout.write(
            f"  counter {result.counter} / expected {result.expected}, "
            f"overlaps {result.overlaps}, max concurrent {result.max_concurrent} / {limit}, "
            f"{result.ops_per_s} ops/s"
            + (
                f", hand-off p50 {result.handoff_ms_p50} ms, p99 {result.handoff_ms_p99} ms"
                if result.handoff_ms_p50 is not None
                else ""
            )
        )
        for error in result.errors:
            self.stderr.write(f"  {error}")
        if result.ok:
            verdict = "PASS"
        elif result.counter != result.expected or result.overlaps or not result.fences_increase:
            verdict = "FAIL: the lock let two holders in"
        else:
            verdict = "FAIL: the run did not complete"
        self.stdout.write(self.style.SUCCESS(verdict) if result.ok else self.style.ERROR(verdict))
        if as_json:
            self.stdout.write(json.dumps(result.as_json()))
        if not result.ok:
            raise CommandError("The strength test failed.", returncode=1)


def _slot(slot: str | None) -> int | str | None:
    if slot is None or slot == GATE:
        return slot
    if not slot.isdigit():
        raise ValueError(f"--slot is a slot number or {GATE!r}, not {slot!r}.")
    return int(slot)


def _accept_django_options(subcommand: ArgumentParser) -> None:
    """Let ``--settings``, ``-v`` and Django's other common options follow the subcommand.

    Unless given there, they keep the value parsed before it (``SUPPRESS``).
    """
    subcommand.add_argument("-v", "--verbosity", type=int, default=SUPPRESS, help=SUPPRESS)
    for flag in DJANGO_VALUES:
        subcommand.add_argument(flag, default=SUPPRESS, help=SUPPRESS)
    for flag in DJANGO_FLAGS:
        subcommand.add_argument(flag, action="store_true", default=SUPPRESS, help=SUPPRESS)


def _fence(holder: HolderInfo) -> str:
    """The holder's fence, or what stands for one the server's view does not show."""
    return "not known yet" if holder.fence is None else str(holder.fence)
