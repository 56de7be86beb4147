"""``manage.py djlocks SUBCOMMAND``: inspect locks and test their strength."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from djlocks.backends import backends
from djlocks.stress import StressPlan, run_stress


class Command(BaseCommand):
    help = "Inspect djlocks' locks and semaphores, and run the strength test."

    def add_arguments(self, parser: ArgumentParser) -> None:
        subcommands = parser.add_subparsers(dest="subcommand", required=True)
        listing = subcommands.add_parser("list", help="Holders and waiters of every name.")
        listing.add_argument("--backend", default=None, help="Only this backend alias.")
        listing.add_argument(
            "--json", action="store_true", dest="as_json", help="One JSON document."
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
            "--json", action="store_true", dest="as_json", help="End with one JSON line."
        )

    def handle(self, *args: Any, subcommand: str, **options: Any) -> None:
        if subcommand == "stress":
            self.stress(**options)
        else:
            self.list(backend=options["backend"], as_json=options["as_json"])

    def list(self, *, backend: str | None, as_json: bool) -> None:
        aliases = [backend] if backend else backends.aliases()
        holders = [holder for alias in aliases for holder in backends[alias].holders()]
        waiters = [waiter for alias in aliases for waiter in backends[alias].waiters()]
        if as_json:
            document = {
                "holders": [{**vars(h), "token": None} for h in holders],
                "waiters": [vars(w) for w in waiters],
            }
            self.stdout.write(json.dumps(document, default=str))
            return
        for h in holders:
            self.stdout.write(
                f"{h.backend}  {h.name}  slot {h.slot}/{h.limit}  fence {h.fence}  "
                f"{h.host}:{h.pid} {h.thread}  since {h.since:%Y-%m-%d %H:%M:%S}  "
                f"expires {h.expires_at:%H:%M:%S}  {h.label}"
            )
        for w in waiters:
            self.stdout.write(
                f"{w.backend}  {w.name}  waiter #{w.position}  {w.host}:{w.pid} {w.thread}  "
                f"since {w.since:%Y-%m-%d %H:%M:%S}  {w.label}"
            )
        if not holders and not waiters:
            self.stdout.write("No holders and no waiters.")

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
        as_json: bool,
        **unused: Any,
    ) -> None:
        if processes < 1 or iterations < 1 or limit < 1:
            raise CommandError("--processes, --iterations and --limit must be at least 1.")
        backends[backend]  # an unknown alias fails here, with the configured ones listed
        plan = StressPlan(backend, processes, iterations, limit, hold_ms, ttl)
        kind = "lock" if limit == 1 else f"semaphore (limit {limit})"
        self.stdout.write(
            f"Strength test of a {kind} on backend {backend!r}: "
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
