"""The contended lock and semaphore workloads for any store: many processes on one name.

A *contender module* (``bench/redis_locks.py``, ``bench/database_locks.py``)
says how its contenders are built; each worker process imports it (which sets
Django up) and calls:

* ``locking(contender, limit) -> (acquire, release)``: one lock (``limit`` 1)
  or semaphore, as the contender's users would write it;
* ``counter(contender) -> (read, write)``: the shared counter, read and
  written as two separate operations on the worker's own connection, so that
  only the lock keeps its updates from being lost;
* ``context(contender)``: a context manager around the whole run (settings);
* ``finish()``: close what the workload opened (the processes run many).

A ``Crew`` of worker processes runs workload after workload. Each worker
records every operation as (asked, got, done, pid) on the monotonic clock
(``CLOCK_MONOTONIC`` is one clock for every process on the machine);
``Crew.run`` turns them into the figures the benchmark reports.
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
import queue
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from djlocks.percentiles import percentile

Operation = tuple[int, int, int, int]  # asked, got, done (monotonic ns), pid
WORKER = "contender-"


def worker_number() -> int:
    """This contending process's number in its ``Crew``, from 0."""
    return int(multiprocessing.current_process().name.removeprefix(WORKER))


@dataclass(frozen=True)
class Workload:
    """``processes`` x ``iterations`` of acquire -> read -> (hold) -> write -> release."""

    contender: str
    iterations: int = 200
    limit: int = 1
    hold: float = 0.0  # seconds between the read and the write


def serve(module_name: str, orders: Any, ready: Any, start: Any, out: Any) -> None:
    """One contending process: runs each ``Workload`` it is given until it gets ``None``.

    For each: warms up, says it is ``ready``, waits for ``start``, puts its
    operations on ``out``, then lets the module close what the workload opened
    (``finish()``).
    """
    module = importlib.import_module(module_name)
    while (workload := orders.get()) is not None:
        out.put(run_once(module, workload, ready, start))
        module.finish()


def run_once(module: Any, workload: Workload, ready: Any, start: Any) -> list[Operation]:
    acquire, release = module.locking(workload.contender, workload.limit)
    read, write = module.counter(workload.contender)
    records: list[Operation] = []
    with module.context(workload.contender):
        acquire()  # warm-up: connections, scripts, subscriptions
        release()
        ready.put(os.getpid())
        start.wait()
        for _ in range(workload.iterations):
            asked = time.monotonic_ns()
            acquire()
            got = time.monotonic_ns()
            value = read()
            if workload.hold:
                time.sleep(workload.hold)
            write(value + 1)
            done = time.monotonic_ns()
            release()
            records.append((asked, got, done, os.getpid()))
    return records


class Crew:
    """``processes`` contending processes of one contender module, started once (starting
    Django in each costs seconds) and given one workload after another, all together."""

    def __init__(self, module: str, processes: int = 8) -> None:
        context = multiprocessing.get_context("spawn")
        self.ready, self.start, self.out = context.Queue(), context.Event(), context.Queue()
        self.orders = [context.Queue() for _ in range(processes)]
        self.workers = [  # named by number: ``worker_number()`` in each
            context.Process(
                target=serve,
                args=(module, orders, self.ready, self.start, self.out),
                name=f"{WORKER}{number}",
            )
            for number, orders in enumerate(self.orders)
        ]
        for process in self.workers:
            process.start()

    def __enter__(self) -> Crew:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None:  # a worker failed, or an interruption: the others may
            for process in self.workers:  # wait at the start line for good
                process.terminate()
        for orders in self.orders:
            orders.put(None)
        for process in self.workers:
            process.join(60)
            if process.is_alive():
                process.terminate()

    def run(self, workload: Workload, reset: Any, final_count: Any) -> dict[str, Any]:
        """Run ``workload``; ``reset()`` zeroes the counter first, ``final_count()`` reads
        it after."""
        reset()
        self.start.clear()  # every worker is back waiting for orders: none can see it set
        for orders in self.orders:
            orders.put(workload)
        collect(self.ready, self.workers)  # every worker is warm and at the start line
        began = time.monotonic()
        self.start.set()
        operations = sorted(collect(self.out, self.workers), key=lambda r: r[1])
        elapsed = time.monotonic() - began
        expected = len(self.workers) * workload.iterations
        result: dict[str, Any] = {
            "contender": workload.contender,
            "ops_per_s": round(expected / elapsed, 1),
            "max_concurrent": most_at_once(operations),
        }
        if workload.limit == 1:  # with several holders the counter is meant to lose updates
            result["lost_updates"] = expected - final_count()
            result.update(handoff_and_barging(operations))
            result["fairness"] = fairness(operations)
        else:
            result["share_of_ideal"] = round(
                result["ops_per_s"] / (workload.limit / workload.hold), 3
            )
        waits = [(got - asked) / 1e6 for asked, got, _, _ in operations]
        result["wait_ms_p99"] = round(percentile(waits, 99) or 0, 2)
        result["wait_ms_max"] = round(max(waits), 2)
        return result


def collect(out: Any, workers: list[Any]) -> list[Any]:
    """One report from every worker; raises as soon as a worker has died without reporting.

    A report that is a list (a worker's operations) is flattened into the result.
    """
    reports: list[Any] = []
    for _ in workers:
        while True:
            try:
                report = out.get(timeout=1)
                reports += report if isinstance(report, list) else [report]
                break
            except queue.Empty:
                failed = [p.exitcode for p in workers if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"contending workers failed: exit codes {failed}") from None
    return reports


def most_at_once(operations: list[Operation]) -> int:
    """The most critical sections (acquire returned -> counter written) open at one time."""
    edges = sorted(
        [(got, 1) for _, got, _, _ in operations] + [(done, -1) for _, _, done, _ in operations]
    )
    open_now = most = 0
    for _, step in edges:
        open_now += step
        most = max(most, open_now)
    return most


def fairness(operations: list[Operation]) -> float:
    """Jain's index of the grants each process got until the first of them had all of
    its own: 1.0 when every process got as many, 1/n when one got them all."""
    last: dict[int, int] = {}
    for _, _, done, pid in operations:
        last[pid] = max(last.get(pid, 0), done)
    first_through = min(last.values())
    counts = Counter(pid for _, _, done, pid in operations if done <= first_through)
    got = [counts[pid] for pid in last]
    return round(sum(got) ** 2 / (len(got) * sum(n * n for n in got)), 3)


def handoff_and_barging(operations: list[Operation]) -> dict[str, Any]:
    """Overlaps; hand-off (a waiting holder's acquire returned after the previous end); barging.

    Barging: after a release while another process was already waiting, how
    often the releasing process got the lock straight back (0 % for FIFO).
    """
    handoffs, barged, contested = [], 0, 0
    for previous, current in itertools.pairwise(operations):
        _, _, released, holder = previous
        someone_waited = any(
            asked < released < got and pid != holder for asked, got, _, pid in operations
        )
        if not someone_waited:
            continue
        contested += 1
        barged += current[3] == holder
        if current[0] < released:  # the next holder was already waiting
            handoffs.append((current[1] - released) / 1e6)
    return {
        "overlaps": sum(1 for a, b in itertools.pairwise(operations) if b[1] < a[2]),
        "handoff_ms_p50": round(statistics.median(handoffs), 3) if handoffs else None,
        "handoff_ms_p99": round(percentile(handoffs, 99) or 0, 3) if handoffs else None,
        "barging_pct": round(100 * barged / contested, 1) if contested else 0.0,
    }
