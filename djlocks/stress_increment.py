"""The program ``djlocks stress --via runlocked`` runs under the lock: one increment.

Run as ``python -I -S stress_increment.py WORKDIR WORKER HOLD_MS`` by
``runlocked``, which passes the grant in ``DJLOCKS_SLOT`` and ``DJLOCKS_FENCE``.
It reads the slot's counter file, holds for a random 0 to 2 x HOLD_MS
milliseconds (or yields the processor), writes the counter plus one, and
appends its hold interval (monotonic nanoseconds, system-wide on Linux) to the
worker's log. Standard library only, so it starts in milliseconds.
"""

import json
import os
import random
import sys
import time


def main() -> None:
    workdir, worker, hold_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
    slot, fence = int(os.environ["DJLOCKS_SLOT"]), int(os.environ["DJLOCKS_FENCE"])
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
    ended = time.monotonic_ns()
    record = {"start": began, "end": ended, "fence": fence, "slot": slot}
    with open(os.path.join(workdir, f"worker-{worker}.jsonl"), "a") as log:
        log.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
