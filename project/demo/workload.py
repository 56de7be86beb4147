"""A small live workload for ``make demo``: cron-like jobs that come and go under
``manage.py runlocked``, so the admin dashboard shows holders and waiters move.

* ``demo:nightly-import``: a lock three jobs queue for (each holds 4-9 s);
* ``demo:pdf-render``: a semaphore of 2 slots five renderers share (2-6 s each);
* ``demo:mailer``: a lock with a 20 s cool-down; its job runs with ``-n`` and skips
  while the cool-down lasts;
* with ``REDIS_URL`` set, ``demo:cache-rebuild``: a semaphore of 2 slots on the
  ``redis`` backend that three rebuilders share (2-5 s each).

Run with ``python -m project.demo.workload``; Ctrl-C or SIGTERM stops it (and
runlocked stops the running jobs with it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

MANAGE = str(Path(__file__).resolve().parent.parent.parent / "manage.py")
stopping = threading.Event()
running: set[subprocess.Popen[bytes]] = set()
guard = threading.Lock()


def job(name: str, label: str, options: list[str], hold: tuple[float, float], rest: float) -> None:
    """Run ``sleep`` under ``runlocked`` again and again until the workload stops."""
    while not stopping.is_set():
        seconds = f"{random.uniform(*hold):.1f}"
        command = [sys.executable, MANAGE, "runlocked", name, "--label", label, *options]
        process = subprocess.Popen([*command, "--", "sleep", seconds], stdout=subprocess.DEVNULL)
        with guard:
            running.add(process)
        process.wait()
        with guard:
            running.discard(process)
        stopping.wait(random.uniform(0.5, rest))


def main() -> None:
    jobs = [
        *(
            ("demo:nightly-import", f"nightly import #{n}", ["--timeout", "60"], (4, 9), 3)
            for n in (1, 2, 3)
        ),
        *(
            (
                "demo:pdf-render",
                f"pdf renderer #{n}",
                ["--limit", "2", "--timeout", "60"],
                (2, 6),
                2,
            )
            for n in (1, 2, 3, 4, 5)
        ),
        ("demo:mailer", "mailer", ["-n", "--cooldown", "20"], (1, 3), 4),
    ]
    if os.environ.get("REDIS_URL"):
        redis_slots = ["--backend", "redis", "--limit", "2", "--timeout", "60"]
        jobs += [
            ("demo:cache-rebuild", f"cache rebuilder #{n}", redis_slots, (2, 5), 2)
            for n in (1, 2, 3)
        ]
    threads = [threading.Thread(target=job, args=spec, daemon=True) for spec in jobs]
    for thread in threads:
        thread.start()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        while not stopping.wait(1):
            pass
    except KeyboardInterrupt:
        stopping.set()
    with guard:
        for process in running:
            process.send_signal(signal.SIGTERM)  # runlocked forwards it and releases
    for thread in threads:
        thread.join(15)


if __name__ == "__main__":
    main()
