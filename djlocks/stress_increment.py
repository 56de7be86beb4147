"""One increment of the strength test, done under the lock; also a program.

As a program it is what ``djlocks stress --via runlocked`` runs under the
lock: ``python -I -S stress_increment.py WORKDIR WORKER HOLD_MS``, with the
grant in ``DJLOCKS_SLOT`` and ``DJLOCKS_FENCE`` as ``runlocked`` passes it.
Standard library only, so it starts in milliseconds.
"""

import json
import os
import random
import sys
import time


def increment(workdir: str, slot: int, hold_ms: float) -> tuple[int, int]:
    """Read the slot's counter file, hold, write it plus one; return the interval.

    The hold lasts a random 0 to 2 x ``hold_ms`` milliseconds, or only yields
    the processor. The interval is on the monotonic clock in nanoseconds,
    which is system-wide on Linux, so intervals of processes compare.
    """
    began = time.monotonic_ns()
    counter = os.path.join(workdir, f"counter-{slot}")
    try:
        with open(counter) as file:
            value = int(file.read() or 0)
    except FileNotFoundError:
        value = 0
    if hold_ms:
        time.sleep(random.uniform(0, 2 * hold_ms) / 1000)
    else:
        os.sched_yield()
    with open(counter, "w") as file:
        file.write(str(value + 1))
    return began, time.monotonic_ns()


def record_hold(
    workdir: str, worker: int, interval: tuple[int, int], fence: int, slot: int
) -> None:
    """Append one believed-hold interval to the worker's log, for the oracles."""
    record = {"start": interval[0], "end": interval[1], "fence": fence, "slot": slot}
    with open(os.path.join(workdir, f"worker-{worker}.jsonl"), "a") as log:
        log.write(json.dumps(record) + "\n")


def main() -> None:
    workdir, worker, hold_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    slot, fence = int(os.environ["DJLOCKS_SLOT"]), int(os.environ["DJLOCKS_FENCE"])
    record_hold(workdir, worker, increment(workdir, slot, hold_ms), fence, slot)


if __name__ == "__main__":
    main()
