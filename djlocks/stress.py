"""The strength test, shared by ``manage.py djlocks stress`` and the tests.

K worker processes (started with ``spawn``, each calling ``django.setup()``)
loop M times: acquire, read a counter from a file outside the lock store,
pause, write it + 1, release. Each slot of a semaphore has its own counter
file, so the oracle holds for semaphores too: two holders of one slot would
lose an update. Every believed-hold interval is recorded on the monotonic
clock (system-wide on Linux) and checked for overlaps afterwards.

``via="runlocked"`` makes it the classic strength test of a lock command:
each worker runs ``manage.py runlocked NAME -- python stress_increment.py``
in a loop, and that small program does the increment under the lock.

``mode="multi"`` tests many names at once (``db_locks``): each iteration takes
``MULTI_SET`` of ``MULTI_NAMES`` names together, chosen at random, and
increments each one's counter. The oracles hold per name (one holder at a time,
no lost update, rising fences), every set taken in full, and the store holds
none of the names once the workers are done.

``mode="leader"`` tests leader election (``djlocks.leadership``): each
iteration campaigns, leads for one increment with the term as its fence, and
steps down. The oracles: one leader at a time (no overlap, no lost update), never
two leaders in one term, terms rising, and nobody leading once the workers are done.

``mode="rw"`` tests readers and writers (``djlocks.db_rwlock``): each iteration
writes (one in ``RW_WRITES``: increments the counter) or reads (holds). The
oracles: never a writer with anyone else, no lost update, writers' fences rising,
nothing held once the workers are done.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from djlocks.leadership import election_name
from djlocks.percentiles import percentile
from djlocks.rwlock import GATE, READERS, RW_PREFIX
from djlocks.stress_increment import increment, record_hold

#: ``mode="multi"``: how many names the workers share, and how many each takes at once.
MULTI_NAMES, MULTI_SET = 4, 2
MODES = ("lock", "multi", "leader", "rw")
#: ``mode="rw"``: the share of iterations that write, and the readers at once.
RW_WRITES, RW_READERS = 0.25, 4
#: ``mode="rw"``: how a recorded interval says who held (in its ``slot``).
WRITER, READER = 0, 1


@dataclass(frozen=True)
class StressPlan:
    backend: str
    processes: int
    iterations: int
    limit: int = 1
    hold_ms: float = 0.0
    ttl: float = 30.0
    name: str = "djlocks:stress"
    kill: int = 0  # how many workers are SIGKILLed while holding (they never release)
    via: str = "api"  # or "runlocked": each increment is a `manage.py runlocked` run
    mode: str = "lock"  # a lock or a semaphore (by limit), or "multi": names together

    def __post_init__(self) -> None:
        if self.via not in ("api", "runlocked"):
            raise ValueError(f"via must be 'api' or 'runlocked', not {self.via!r}.")
        if self.via == "runlocked" and self.kill:
            raise ValueError("Killing holders is a test of the API workers, not of runlocked.")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}.")
        if self.mode == "multi" and (self.limit != 1 or self.via != "api" or self.kill):
            raise ValueError(
                "mode 'multi' takes locks (limit 1) through the API, and kills no holder."
            )
        if self.mode in ("leader", "rw") and (self.limit != 1 or self.via != "api"):
            raise ValueError(f"mode {self.mode!r} runs through the API, without --limit.")
        if self.mode == "rw" and self.kill:
            raise ValueError("mode 'rw' kills no holder.")

    @property
    def names(self) -> list[str]:
        """The names the workers take: one, or ``MULTI_NAMES`` in mode ``multi``."""
        if self.mode == "multi":
            return [f"{self.name}:{index}" for index in range(MULTI_NAMES)]
        if self.mode == "leader":
            return [election_name(self.name)]
        if self.mode == "rw":
            return [RW_PREFIX + self.name + GATE, RW_PREFIX + self.name + READERS]
        return [self.name]


@dataclass
class StressResult:
    backend: str
    processes: int
    iterations: int
    limit: int
    expected: int
    counter: int
    overlaps: int
    max_concurrent: int
    ops_per_s: float
    handoff_ms_p50: float | None
    handoff_ms_p99: float | None
    fences_increase: bool
    killed: int
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.counter == self.expected
            and self.overlaps == 0
            and self.max_concurrent <= self.limit
            and self.fences_increase
            and not self.errors
        )

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _worker(
    plan: StressPlan,
    worker: int,
    database_names: dict[str, str],
    workdir: str,
    start: Any,
    victim: bool,
) -> None:
    """Body of one spawned worker process (see the module docstring)."""
    import django

    pin_database_names(database_names)
    django.setup()
    from djlocks import Lock, Semaphore

    if plan.mode == "multi":
        _take_sets(plan, worker, workdir, start)
        return
    if plan.mode == "leader":
        _lead_in_turns(plan, worker, workdir, start, victim)
        return
    if plan.mode == "rw":
        _read_or_write(plan, worker, workdir, start)
        return

    spec: Lock = (
        Lock(plan.name, ttl=plan.ttl, backend=plan.backend, label=f"stress worker {worker}")
        if plan.limit == 1
        else Semaphore(
            plan.name,
            limit=plan.limit,
            ttl=plan.ttl,
            backend=plan.backend,
            label=f"stress worker {worker}",
        )
    )
    start.wait()
    for iteration in range(plan.iterations):
        with spec as grant:
            if victim and iteration == plan.iterations // 2:
                os.kill(os.getpid(), signal.SIGKILL)  # dies holding: the lease must expire
            interval = increment(workdir, grant.slot, plan.hold_ms)
        record_hold(workdir, worker, interval, grant.fence, grant.slot)


def _take_sets(plan: StressPlan, worker: int, workdir: str, start: Any) -> None:
    """Mode ``multi``: take ``MULTI_SET`` names at once; the counter of each is its slot."""
    from djlocks import db_locks

    names, chooser = plan.names, random.Random(worker)
    start.wait()
    for _ in range(plan.iterations):
        chosen = sorted(chooser.sample(range(len(names)), MULTI_SET))
        taken = db_locks(
            [names[index] for index in chosen],
            ttl=plan.ttl,
            backend=plan.backend,
            label=f"stress worker {worker}",
        )
        with taken as grants:
            held = [
                (index, increment(workdir, index, plan.hold_ms), grants[names[index]].fence)
                for index in chosen
            ]
        for index, interval, fence in held:
            record_hold(workdir, worker, interval, fence, index)


def _lead_in_turns(plan: StressPlan, worker: int, workdir: str, start: Any, victim: bool) -> None:
    """Mode ``leader``: win the election, increment as the leader, step down; a victim
    dies leading (its lease must run out for a standby to take over)."""
    from djlocks import leadership

    start.wait()
    for iteration in range(plan.iterations):
        with leadership(
            plan.name, ttl=plan.ttl, backend=plan.backend, label=f"stress worker {worker}"
        ) as leader:
            term = leader.term
            if victim and iteration == plan.iterations // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            interval = increment(workdir, 0, plan.hold_ms)
            if not leader.is_leader or term is None:
                raise SystemExit(f"deposed in term {term}, during the increment")
        record_hold(workdir, worker, interval, term, 0)


def _read_or_write(plan: StressPlan, worker: int, workdir: str, start: Any) -> None:
    """Mode ``rw``: write (increment) one time in ``RW_WRITES``, else read (hold)."""
    from djlocks import db_rwlock

    rw = db_rwlock(
        plan.name,
        max_readers=RW_READERS,
        ttl=plan.ttl,
        backend=plan.backend,
        label=f"stress worker {worker}",
    )
    chooser = random.Random(worker)
    start.wait()
    for _ in range(plan.iterations):
        writes = chooser.random() < RW_WRITES
        with rw.write() if writes else rw.read() as grant:
            if writes:
                interval = increment(workdir, 0, plan.hold_ms)
            else:
                began = time.monotonic_ns()
                time.sleep(chooser.uniform(0, 2 * plan.hold_ms) / 1000)
                interval = (began, time.monotonic_ns())
        record_hold(workdir, worker, interval, grant.fence, WRITER if writes else READER)


def _runlocked_worker(
    plan: StressPlan,
    worker: int,
    database_names: dict[str, str],
    workdir: str,
    start: Any,
    victim: bool,
) -> None:
    """Body of one worker of the runlocked strength test: a loop of runlocked runs."""
    increment = str(Path(__file__).with_name("stress_increment.py"))
    command = [
        *manage_command(database_names),
        *("runlocked", plan.name, "--backend", plan.backend, "--limit", str(plan.limit)),
        *("--ttl", str(plan.ttl), "--label", f"stress worker {worker}", "--quiet", "--"),
        *(sys.executable, "-I", "-S", increment, workdir, str(worker), str(plan.hold_ms)),
    ]
    start.wait()
    for _ in range(plan.iterations):
        status = subprocess.run(command, check=False).returncode
        if status != 0:
            raise SystemExit(f"runlocked exited with status {status}")


def current_database_names() -> dict[str, str]:
    """This process's database names by alias, for ``pin_database_names`` in a child."""
    from django.db import connections

    return {alias: str(connections[alias].settings_dict["NAME"]) for alias in connections}


def pin_database_names(names: dict[str, str]) -> None:
    """Point this process's settings at the parent's databases (test databases included)."""
    from django.conf import settings

    for alias, name in names.items():
        settings.DATABASES[alias]["NAME"] = name


def manage_command(database_names: dict[str, str]) -> list[str]:
    """The start of a ``manage.py`` command line that uses these databases (see ``manage``)."""
    return [
        sys.executable,
        "-c",
        "from djlocks.stress import manage; manage()",
        json.dumps(database_names),
    ]


def manage() -> None:
    """``manage.py`` with the database names pinned: ``python -c ... NAMES_JSON COMMAND ...``."""
    from django.core.management import execute_from_command_line

    pin_database_names(json.loads(sys.argv[1]))
    execute_from_command_line(["manage.py", *sys.argv[2:]])


def analyse(plan: StressPlan, intervals: list[dict[str, int]], counter: int) -> StressResult:
    """Apply the oracles to recorded believed-hold intervals (nanoseconds, monotonic)."""
    if plan.mode == "rw":
        return _analyse_readers_and_writers(plan, intervals, counter)
    ordered = sorted(intervals, key=lambda interval: interval["start"])
    # The intervals of each name: in mode "multi" a slot is a name of its own.
    names: dict[int, list[dict[str, int]]] = {}
    for interval in ordered:
        names.setdefault(interval["slot"] if plan.mode == "multi" else 0, []).append(interval)
    overlaps = max_concurrent = 0
    handoffs: list[float] = []
    fences_increase = True
    for held in names.values():
        concurrent = 0
        for _, step in sorted(
            [(i["start"], 1) for i in held] + [(i["end"], -1) for i in held],
            key=lambda event: (event[0], event[1]),
        ):
            concurrent += step
            if step == 1 and concurrent > plan.limit:
                overlaps += 1
            max_concurrent = max(max_concurrent, concurrent)
        if plan.limit == 1:
            handoffs += [
                (after["start"] - before["end"]) / 1e6
                for before, after in itertools.pairwise(held)
                if after["start"] >= before["end"]
            ]
        fences = [interval["fence"] for interval in held]
        by_slot: dict[int, list[int]] = {}
        for interval in held:
            by_slot.setdefault(interval["slot"], []).append(interval["fence"])
        # Holders of one slot follow each other, so their fences must rise in start
        # order; across a name's slots a fence is never handed out twice.
        fences_increase = fences_increase and len(set(fences)) == len(fences)
        fences_increase = fences_increase and all(
            a < b for slot_fences in by_slot.values() for a, b in itertools.pairwise(slot_fences)
        )
    span = (ordered[-1]["end"] - ordered[0]["start"]) / 1e9 if ordered else 0.0
    completed = plan.processes * plan.iterations - plan.kill * (
        plan.iterations - plan.iterations // 2
    )
    if plan.mode == "multi":
        completed *= MULTI_SET
    return StressResult(
        backend=plan.backend,
        processes=plan.processes,
        iterations=plan.iterations,
        limit=plan.limit,
        expected=completed,
        counter=counter,
        overlaps=overlaps,
        max_concurrent=max_concurrent,
        ops_per_s=round(len(ordered) / span, 1) if span else 0.0,
        handoff_ms_p50=_round(percentile(handoffs, 50)),
        handoff_ms_p99=_round(percentile(handoffs, 99)),
        fences_increase=fences_increase,
        killed=plan.kill,
    )


def _analyse_readers_and_writers(
    plan: StressPlan, intervals: list[dict[str, int]], counter: int
) -> StressResult:
    """Mode ``rw``: a writer overlaps nobody; writers' fences rise; each write counted."""
    ordered = sorted(intervals, key=lambda interval: interval["start"])
    writers = [interval for interval in ordered if interval["slot"] == WRITER]
    overlaps = sum(
        1
        for writer in writers
        for other in ordered
        if other is not writer and other["start"] < writer["end"] and writer["start"] < other["end"]
    )
    fences = [writer["fence"] for writer in writers]
    span = (ordered[-1]["end"] - ordered[0]["start"]) / 1e9 if ordered else 0.0
    return StressResult(
        backend=plan.backend,
        processes=plan.processes,
        iterations=plan.iterations,
        limit=1,
        expected=len(writers),
        counter=counter,
        overlaps=overlaps,
        max_concurrent=1 if writers else 0,  # of writers: any second one is an overlap
        ops_per_s=round(len(ordered) / span, 1) if span else 0.0,
        handoff_ms_p50=None,
        handoff_ms_p99=None,
        fences_increase=all(a < b for a, b in itertools.pairwise(fences)),
        killed=0,
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run_stress(plan: StressPlan, timeout: float = 600.0) -> StressResult:
    """Run the strength test with real processes against the configured store."""
    database_names = current_database_names()
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    with tempfile.TemporaryDirectory(prefix="djlocks-stress-") as workdir:
        body = _runlocked_worker if plan.via == "runlocked" else _worker
        workers = [
            context.Process(
                target=body,
                args=(plan, worker, database_names, workdir, start, worker < plan.kill),
                daemon=True,
            )
            for worker in range(plan.processes)
        ]
        for process in workers:
            process.start()
        start.set()
        deadline = time.monotonic() + timeout
        errors = []
        for worker, process in enumerate(workers):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                errors.append(f"worker {worker} did not finish within {timeout} s")
            elif process.exitcode != 0 and worker >= plan.kill:
                errors.append(f"worker {worker} exited with status {process.exitcode}")
        intervals: list[dict[str, int]] = []
        for path in Path(workdir).glob("worker-*.jsonl"):
            intervals.extend(json.loads(line) for line in path.read_text().splitlines())
        counter = sum(int(path.read_text() or 0) for path in Path(workdir).glob("counter-*"))
    result = analyse(plan, intervals, counter)
    result.errors.extend(errors)
    if plan.mode in ("multi", "leader", "rw"):  # nothing left held: no set, leader, reader
        left = _still_held(plan)
        if left:
            result.errors.append(f"still held once every worker was done: {left}")
    return result


def _still_held(plan: StressPlan) -> list[str]:
    """The plan's names still held once the workers are done; a killed worker's lease is
    given up to its TTL (and a second) to run out."""
    from djlocks.backends import backends

    store = backends[plan.backend]
    waits_for_leases = plan.kill and store.capabilities.crash_release == "ttl"
    deadline = time.monotonic() + (plan.ttl + 1.0 if waits_for_leases else 0.0)
    while True:
        left = sorted({h.name for h in store.holders() if h.name in plan.names})
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
