"""Python bytecodes per uncontended acquire + release: djlocks' own work, by a count that
a noisy machine does not blur (CPU time on a shared host drifts from run to run).

One lock of the backend ``alias`` is taken and released ``--pairs`` times, after a
warm-up, with ``sys.settrace`` counting opcode events (djlocks, Django and the
drivers' Python alike). The count is split where the next holder of a contended
lock waits: the part of ``acquire`` after the locking statement's reply, and the
part of ``release`` before its statement is sent, are the *hand-off path*; the
rest overlaps other holders' waits. The statements are the session backends'
(``DirectStatements._run``, ``value_at_once``) and the Redis backend's scripts
(``_evalsha``); for other backends only the total is meaningful.

Usage: DJLOCKS_DB=postgresql|mysql python bench/bytecodes.py [alias] [--history]
Prints one JSON document: bytecodes per pair, in each part.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from djlocks import db_lock  # noqa: E402

#: The functions that send a session lock's statement and wait for its reply.
STATEMENTS = ("_run", "value_at_once")
#: The same for the Redis backend's scripts (its ``_run`` names the Python before one).
REDIS_STATEMENTS = ("_evalsha",)
PAIRS = 20


class Counting:
    """A tracer that counts opcodes per part: ``acquire`` or ``release``, then
    ``-statement`` inside a statement and ``-after`` once it returned."""

    def __init__(self, statements: tuple[str, ...]) -> None:
        self.part = ""
        self.counts: Counter[str] = Counter()
        self.statements = statements

    def begin(self, part: str) -> None:
        self.part = part

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.counts[self.part] += 1
        elif frame.f_code.co_name in self.statements and event in ("call", "return"):
            kind = self.part.split("-")[0]
            self.part = f"{kind}-statement" if event == "call" else f"{kind}-after"
        return self


def count(alias: str, history: bool, pairs: int = PAIRS) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    with override_settings(DJLOCKS={**settings.DJLOCKS, "EVENTS": history}):
        lock = db_lock("bench:bytecodes", backend=alias)
        for _ in range(50):  # warm-up: connections, prepared statements, threads
            with lock:
                pass
        tracer = Counting(REDIS_STATEMENTS if alias.startswith("redis") else STATEMENTS)
        sys.settrace(tracer)
        try:
            for _ in range(pairs):
                tracer.begin("acquire")
                lock.acquire()
                tracer.begin("release")
                lock.release()
        finally:
            sys.settrace(None)
    per_pair = {part: round(n / pairs) for part, n in sorted(tracer.counts.items()) if part}
    return {
        "alias": alias,
        "history": history,
        "pair": sum(per_pair.values()),
        "hand_off_path": per_pair.get("acquire-after", 0) + per_pair.get("release", 0),
        "parts": per_pair,
    }


if __name__ == "__main__":
    names = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    print(json.dumps(count(names[0] if names else "session", "--history" in sys.argv)))
