"""``manage.py runlocked NAME [options] -- COMMAND [ARG ...]``: see ``djlocks.runlocked``."""

from __future__ import annotations

import sys
from argparse import ArgumentParser
from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from djlocks.backends import backends
from djlocks.backends.base import LimitAboveMost
from djlocks.exceptions import BackendUnavailable
from djlocks.runlocked import (
    EXIT_CONFLICT,
    EXIT_LOST,
    EXIT_UNAVAILABLE,
    RunLockedPlan,
    Supervisor,
)

USAGE_ERROR = 2


class Command(BaseCommand):
    help = (
        "Run COMMAND while holding the lock NAME (or one of --limit slots), renewing its "
        "lease while it runs and releasing it on every exit path. Exit status: the "
        f"command's own; 128+N if it died by signal N; {EXIT_CONFLICT} (or "
        f"--conflict-exit-code) if the lock was not acquired; {EXIT_LOST} if the lock was "
        f"lost, or an operator asked for it back, while the command ran (the command is "
        f"then terminated, and killed before its lease could end); {EXIT_UNAVAILABLE} "
        f"if the lock store could not be reached or cannot hold session locks (a pooler "
        f"sharing server sessions); {USAGE_ERROR} for bad usage."
    )
    # Start-up time matters for a cron wrapper; `manage.py check` covers the checks.
    requires_system_checks: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.command_to_run: list[str] | None = None

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.usage = "%(prog)s NAME [options] -- COMMAND [ARG ...]"
        parser.add_argument("name", help="The lock's name, shared by every server's crontab.")
        parser.add_argument(
            "--limit", type=int, default=1, help="Run at most N at once (a semaphore)."
        )
        wait = parser.add_mutually_exclusive_group()
        wait.add_argument(
            "--timeout", type=float, default=None, help="Seconds to wait (default: forever)."
        )
        wait.add_argument("-n", "--nonblock", action="store_true", help="Try once; do not wait.")
        parser.add_argument("--ttl", type=float, default=None, help="Lease length in seconds.")
        parser.add_argument(
            "--max-hold",
            type=float,
            default=None,
            help="Seconds the command may hold the lock, at most (default: "
            "DJLOCKS['MAX_HOLD'], else no bound); past it the command is stopped as "
            "for a lost lock.",
        )
        parser.add_argument(
            "--cooldown",
            type=float,
            default=0.0,
            help="Seconds the name stays unavailable after the command ends.",
        )
        parser.add_argument("--backend", default="default", help="An alias of DJLOCKS.")
        parser.add_argument(
            "--label", default=None, help="What operators see (default: the command line)."
        )
        parser.add_argument(
            "--conflict-exit-code",
            type=int,
            default=EXIT_CONFLICT,
            help=f"Exit status when the lock is not acquired (default {EXIT_CONFLICT}).",
        )
        parser.add_argument(
            "--kill-after",
            type=float,
            default=10.0,
            help="Seconds between SIGTERM and SIGKILL when the lock is lost or an operator "
            "asks for it back (default 10). SIGKILL comes sooner if the lease could end "
            "sooner: the command never runs past the moment its lease could end.",
        )
        parser.add_argument(
            "--standby",
            action="store_true",
            help="Hot standby: wait to become the leader of NAME (as djlocks.leadership "
            "does), run the command while leading, with its term in DJLOCKS_TERM; when "
            "deposed, stop the command and stand by again. Run one on every server.",
        )
        parser.add_argument(
            "-q", "--quiet", action="store_true", help="Say nothing (same as -v 0)."
        )

    def run_from_argv(self, argv: list[str]) -> None:
        """Split ``manage.py runlocked ... -- COMMAND`` at the first ``--``."""
        if "--" not in argv and not {"-h", "--help"} & set(argv):
            self._usage_error(argv, "put the command to run after --, e.g. runlocked NAME -- true")
        separator = argv.index("--") if "--" in argv else len(argv)
        self.command_to_run = argv[separator + 1 :]
        if not self.command_to_run and separator < len(argv):
            self._usage_error(argv, "no command after --")
        super().run_from_argv(argv[:separator])

    def _usage_error(self, argv: list[str], message: str) -> NoReturn:
        self._called_from_command_line = True
        self.create_parser(argv[0], argv[1]).error(message)
        raise AssertionError("unreachable: argparse exits")

    def handle(self, *args: Any, **options: Any) -> NoReturn:
        if not self.command_to_run:
            raise CommandError(
                "runlocked runs the command given after -- on the command line; "
                "from Python code use `with djlocks.db_lock(NAME):` instead.",
                returncode=USAGE_ERROR,
            )
        verbosity = 0 if options["quiet"] else options["verbosity"]
        try:
            backend = backends[options["backend"]]  # ImproperlyConfigured if unknown
            if options["cooldown"] and not backend.capabilities.cooldowns:
                raise ValueError(
                    f"--cooldown needs a backend that can hold a released slot back (a "
                    f"lease or Redis backend); djlocks backend {options['backend']!r} cannot."
                )
            plan = RunLockedPlan(
                name=options["name"],
                command=self.command_to_run,
                limit=options["limit"],
                timeout=0.0 if options["nonblock"] else options["timeout"],
                ttl=options["ttl"],
                max_hold=options["max_hold"],
                cooldown=options["cooldown"],
                backend=options["backend"],
                label=options["label"],
                conflict_exit_code=options["conflict_exit_code"],
                kill_after=options["kill_after"],
                verbosity=verbosity,
                standby=options["standby"],
            )
            supervisor = Supervisor(plan, report=sys.stderr)
        except (ValueError, TypeError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc), returncode=USAGE_ERROR) from exc
        except BackendUnavailable as exc:  # a backend that cannot be used here at all
            raise CommandError(str(exc), returncode=EXIT_UNAVAILABLE) from exc
        try:
            status = supervisor.run()
        except LimitAboveMost as exc:  # known only to the backend, at the first acquire
            raise CommandError(str(exc), returncode=USAGE_ERROR) from exc
        except (BackendUnavailable, ImproperlyConfigured) as exc:
            raise CommandError(str(exc), returncode=EXIT_UNAVAILABLE) from exc
        sys.exit(status)
