"""``manage.py djlocks list|show|release|sweep|stress``: inspect, force, clean, test."""

from __future__ import annotations

import json
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from djlocks.arguments import validate_name
from djlocks.backends import backends
from djlocks.backends.session import SessionBackend
from djlocks.events import events
from djlocks.inspection import Snapshot, force_release, snapshot
from djlocks.keys import GATE, table_key
from djlocks.stress import StressPlan, run_stress

USAGE_ERROR = 2


class Command(BaseCommand):
    help = "Inspect djlocks' locks and semaphores, release them by force, sweep, stress-test."

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
            help="Take a name's grants away by force; each holder learns LockLost.",
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

        keying = subcommands.add_parser(
            "key", help="The key a name has in the store, for scripts using mysql or psql."
        )
        keying.add_argument("name")
        keying.add_argument("--backend", default="default")
        keying.add_argument(
            "--slot", default=None, help="A semaphore's slot number, or 'gate' for its waiters."
        )

        subcommands.add_parser(
            "sweep", help="Remove expired grants and dead waiters; safe to run from cron."
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
            "--via",
            choices=["api", "runlocked"],
            default="api",
            help="runlocked: each increment is a `manage.py runlocked NAME -- program` run.",
        )
        stress.add_argument(
            "--json", action="store_true", dest="as_json", help="End with one JSON line."
        )

    def handle(self, *args: Any, subcommand: str, **options: Any) -> None:
        try:
            if options.get("backend"):
                backends[options["backend"]]  # an unknown alias fails here, listing the known
            getattr(self, subcommand)(**options)
        except (ImproperlyConfigured, ValueError) as exc:
            raise CommandError(str(exc), returncode=USAGE_ERROR) from exc

    # -- list and show -------------------------------------------------------

    def list(self, *, backend: str | None, as_json: bool, **unused: Any) -> None:
        self._print(snapshot(backend=backend), as_json, nothing="No holders and no waiters.")

    def show(self, *, name: str, backend: str | None, as_json: bool, **unused: Any) -> None:
        self._print(
            snapshot(name, backend),
            as_json,
            nothing=f"{name!r} is free: no holder, no waiter, no cool-down.",
        )

    def _print(self, found: Snapshot, as_json: bool, *, nothing: str) -> None:
        for alias, reason in found.unavailable.items():
            self.stderr.write(f"backend {alias!r} could not be asked: {reason}")
        if as_json:
            self.stdout.write(json.dumps(found.as_json(), default=str))
            return
        for h in found.holders:
            expiry = "session" if h.expires_at is None else f"{h.expires_at:%H:%M:%S}"
            connection = "" if h.connection_id is None else f"  connection {h.connection_id}"
            self.stdout.write(
                f"{h.backend}  {h.name}  slot {h.slot}/{h.limit}  fence {h.fence}  "
                f"{h.host}:{h.pid} {h.thread}  since {h.since:%Y-%m-%d %H:%M:%S}  "
                f"expires {expiry}{connection}  {h.label}"
            )
        for w in found.waiters:
            self.stdout.write(
                f"{w.backend}  {w.name}  waiter #{w.position}  {w.host}:{w.pid} {w.thread}  "
                f"since {w.since:%Y-%m-%d %H:%M:%S}  {w.label}"
            )
        for c in found.cooldowns:
            self.stdout.write(
                f"{c.backend}  {c.name}  slot {c.slot}  cool-down until {c.until:%H:%M:%S}"
            )
        if found.empty and not found.unavailable:
            self.stdout.write(nothing)

    # -- release -------------------------------------------------------------

    def release(
        self,
        *,
        name: str,
        backend: str | None,
        holder: int | None,
        reason: str,
        yes: bool,
        **unused: Any,
    ) -> None:
        holders = snapshot(name, backend).holders
        if holder is not None:
            holders = [h for h in holders if h.fence == holder]
        if not holders:
            which = f"with fence {holder}" if holder is not None else "at all"
            raise CommandError(f"Nobody holds {name!r} {which}; nothing to release.")
        for h in holders:
            self.stdout.write(
                f"{h.backend}  {h.name}  slot {h.slot}  fence {h.fence}  "
                f"held by {h.host}:{h.pid} since {h.since:%Y-%m-%d %H:%M:%S}  {h.label}"
            )
        if not yes:
            self._confirm(len(holders))
        released = force_release(holders, reason=reason)
        self.stdout.write(
            f"Released {len(released)} grant(s) of {name!r}; each holder gets LockLost at its "
            f"next check, renewal or release, and a runlocked holder stops its command."
        )

    def _confirm(self, count: int) -> None:
        if not sys.stdin.isatty():
            raise CommandError(
                "Not asking for confirmation without a terminal: add --yes to release.",
                returncode=USAGE_ERROR,
            )
        answer = input(f"Release these {count} grant(s) by force? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            raise CommandError("Nothing released.")

    # -- key -----------------------------------------------------------------

    def key(self, *, name: str, backend: str, slot: str | None, **unused: Any) -> None:
        store = backends[backend]
        if not isinstance(store, SessionBackend):
            raise CommandError(
                f"Backend {backend!r} keeps names in table rows under name_key = "
                f"{table_key(name)} (the SHA-256 of the name); only session backends "
                f"have server lock keys.",
                returncode=USAGE_ERROR,
            )
        self.stdout.write(str(store.key(validate_name(name), _slot(slot))))

    # -- sweep ---------------------------------------------------------------

    def sweep(self, **unused: Any) -> None:
        for alias in backends.aliases():
            removed = backends[alias].sweep()
            summary = ", ".join(f"{count} {kind}" for kind, count in removed.items())
            self.stdout.write(f"{alias}: {summary or 'nothing to sweep'}")
        self.stdout.write(f"history: {events.sweep()} event(s) past the retention deleted")

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
        as_json: bool,
        **unused: Any,
    ) -> None:
        if processes < 1 or iterations < 1 or limit < 1:
            raise CommandError(
                "--processes, --iterations and --limit must be at least 1.",
                returncode=USAGE_ERROR,
            )
        plan = StressPlan(backend, processes, iterations, limit, hold_ms, ttl, via=via)
        kind = "lock" if limit == 1 else f"semaphore (limit {limit})"
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
