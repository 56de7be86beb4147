"""Uncontended acquire + release pairs of several contenders, timed in interleaved
rounds so that drift on a noisy machine hits every contender alike."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from djlocks.percentiles import percentile

Handle = tuple[Callable[[], object], Callable[[], object]]
WARM_UP = 50  # untimed pairs per contender first: connections, scripts, first use


def time_pairs(
    handles: Mapping[str, Handle],
    pairs: int,
    rounds: int,
    context: Callable[[str], contextlib.AbstractContextManager[Any]],
    between: Callable[[], object] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds of each of ``pairs`` acquire+release pairs per contender (``handles``:
    its acquire and release), run in ``rounds`` rounds, every contender's batch
    inside ``context(contender)`` and after ``between()``. Each round runs the
    contenders in an order of its own (shuffled, the same in every run), so that
    no contender always follows the same one: a batch can run faster or slower for
    what the batch before it left behind (its background writers, the server's
    state), by 1.4 to 1.7 times for djlocks' PostgreSQL session lock right after
    the lease or row lock's batch."""
    for contender, (acquire, release) in handles.items():
        with context(contender):
            for _ in range(WARM_UP):
                acquire()
                release()
    times: dict[str, list[float]] = {contender: [] for contender in handles}
    for round_number in range(rounds):
        order = list(handles.items())
        random.Random(round_number).shuffle(order)
        for contender, (acquire, release) in order:
            between()
            with context(contender):
                for _ in range(pairs // rounds):
                    began = time.perf_counter()
                    acquire()
                    release()
                    times[contender].append(time.perf_counter() - began)
    return times


def summary(contender: str, samples: list[float], floor: float) -> dict[str, Any]:
    """One row of an uncontended table: median and p99 in µs, the median over ``floor``
    (seconds: the round trip of the contender's store)."""
    return {
        "contender": contender,
        "median_us": round(statistics.median(samples) * 1e6, 1),
        "p99_us": round((percentile(samples, 99) or 0) * 1e6, 1),
        "x_rtt": round(statistics.median(samples) / floor, 2),
    }
