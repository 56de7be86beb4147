"""The benchmark's targets, each checked against the figures of one ``make bench`` run:
ratios to the raw primitives, the peers and the floors measured in that same run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

OFF = " (history off)"
ON = " (history on)"
RAW = {"mysql": "raw GET_LOCK / RELEASE_LOCK", "postgresql": "raw pg_advisory_lock / unlock"}
PEER = {"mysql": "django-mysql Lock", "postgresql": "django-pglock advisory"}
SLOTS = {
    "mysql": "raw GET_LOCK slots (2 ms poll)",
    "postgresql": "raw pg_try_advisory_lock slots (2 ms poll)",
}
TWO_UPSERTS = "floor: two single-row autocommit upserts"
#: Hand-off medians (ms), by backend and database.
HANDOFF_MS = {
    ("session", "postgresql"): 0.3,
    ("session", "mysql"): 0.3,
    ("default", "postgresql"): 1.5,
    ("default", "mysql"): 2.0,
}
#: Semaphore throughput at least this share of the raw slot-polling peer's.
SEMAPHORE_RATIO = {"session": 1.0, "default": 0.9}
SERVERS = ("postgresql", "mysql")
#: Where djlocks promises first come, first served (MySQL's GET_LOCK and row locks,
#: and SQLite's write lock, grant waiters in no promised order).
FIFO = {"default": ("sqlite", "postgresql", "mysql"), "session": ("postgresql",)}
Check = tuple[str, str, bool]  # target, what was measured, met


def by_database(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {run["database"]: run for run in runs}


def rows(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {entry["contender"]: entry for entry in entries}


def checks(report: dict[str, Any]) -> Iterator[Check]:
    """Every target the run has figures for (a backend missing from the run is skipped)."""
    yield from uncontended(report)
    yield from contended(report)
    yield from semaphores(report)
    yield from task_queues(report)
    for run in report["runlocked_startup"]:
        for row in run["runlocked"]:
            yield (
                f"runlocked ({run['database']}, {row['backend']}) <= 1.3x `manage.py version`",
                f"{row['x_version']}x",
                row["x_version"] <= 1.3,
            )
    for run in report["dashboard_scale"]:
        page, listing = run["overview_page_s"], run["list_json_s"]
        yield f"dashboard, 10,000 names ({run['database']}) <= 0.5 s", f"{page} s", page <= 0.5
        yield f"`djlocks list --json` ({run['database']}) <= 1 s", f"{listing} s", listing <= 1


def uncontended(report: dict[str, Any]) -> Iterator[Check]:
    """Session locks at or below the best peer on the same database; leases at most 1.2x
    two durable single-row upserts; Redis within 0.5 x RTT of redis-py's ``Lock``."""
    for database, run in by_database(report["uncontended"]).items():
        if database not in SERVERS:
            continue
        found = rows(run["results"])
        session, peer = found.get(f"djlocks session{OFF}"), found.get(PEER[database])
        if session is not None and peer is not None:
            yield (
                f"uncontended, session on {database} <= {PEER[database]} ({peer['x_rtt']} x RTT)",
                f"{session['x_rtt']} x RTT",
                session["x_rtt"] <= peer["x_rtt"],
            )
        lease, upserts = found.get(f"djlocks default{OFF}"), found.get(TWO_UPSERTS)
        if lease is not None and upserts is not None:
            versus = lease["median_us"] / upserts["median_us"]
            yield (
                f"uncontended, lease on {database} <= 1.2x two autocommit upserts",
                f"{versus:.2f}x",
                versus <= 1.2,
            )
        yield from history_cost(found, database, "uncontended", "median_us", slower=True)
    redis = rows(report["redis_locks"]["uncontended"])
    yield from history_cost(redis, "redis", "uncontended", "median_us", slower=True)
    ours, peer = redis.get(f"djlocks redis{OFF}"), redis.get("redis-py Lock")
    if ours is not None and peer is not None:
        yield (
            f"uncontended, redis <= redis-py Lock + 0.5 x RTT ({peer['x_rtt']} x RTT)",
            f"{ours['x_rtt']} x RTT",
            ours["x_rtt"] <= peer["x_rtt"] + 0.5,
        )


def history_cost(
    found: dict[str, dict[str, Any]], where: str, workload: str, figure: str, *, slower: bool
) -> Iterator[Check]:
    """History on costs at most 10 % against history off, for each djlocks backend with
    both figures: ``figure`` is a time (``slower``: on may be at most 1.1x off) or a
    throughput (on must be at least off / 1.1)."""
    for label, off in found.items():
        if not label.endswith(OFF):
            continue
        on = found.get(label.removesuffix(OFF) + ON)
        if on is None or not off[figure] or not on[figure]:
            continue
        cost = on[figure] / off[figure] - 1 if slower else off[figure] / on[figure] - 1
        yield (
            f"history on costs <= 10 %, {workload}: {label.removesuffix(OFF)} on {where}",
            f"{cost:+.0%}",
            cost <= 0.10,
        )


def contended(report: dict[str, Any]) -> Iterator[Check]:
    """8 processes: session locks >= 0.95x the raw primitive and ahead of the best peer,
    leases >= 0.5x, row locks >= 0.6x; hand-off medians; no lost update, no overlap, no
    barging where FIFO is promised."""
    for database, run in by_database(report["database_locks"]).items():
        found = rows(run["contended"])
        yield from history_cost(found, database, "contended", "ops_per_s", slower=False)
        raw, peer = found.get(RAW.get(database, "")), found.get(PEER.get(database, ""))
        for alias, ratio in (("session", 0.95), ("default", 0.5), ("row", 0.6)):
            entry = found.get(f"djlocks {alias}{OFF}")
            if entry is None or raw is None:
                continue
            versus = entry["ops_per_s"] / raw["ops_per_s"]
            yield (
                f"contended, {alias} on {database} >= {ratio}x the raw primitive",
                f"{versus:.2f}x",
                versus >= ratio,
            )
            if alias == "session" and peer is not None:
                yield (
                    f"contended, session on {database} ahead of {PEER[database]}",
                    f"{entry['ops_per_s']} vs {peer['ops_per_s']} ops/s",
                    entry["ops_per_s"] > peer["ops_per_s"],
                )
            bound = HANDOFF_MS.get((alias, database))
            if bound is not None:
                yield (
                    f"hand-off median, {alias} on {database} <= {bound} ms",
                    f"{entry['handoff_ms_p50']} ms",
                    entry["handoff_ms_p50"] is not None and entry["handoff_ms_p50"] <= bound,
                )
        for label, entry in found.items():
            if not label.startswith("djlocks"):
                continue
            yield (
                f"no lost update, no overlap: {label} on {database}",
                f"{entry['lost_updates']} lost, {entry['overlaps']} overlaps",
                entry["lost_updates"] == 0 and entry["overlaps"] == 0,
            )
            if database in FIFO.get(label.split()[1], ()):
                yield (
                    f"barging 0 % (FIFO promised): {label} on {database}",
                    f"{entry['barging_pct']} %",
                    entry["barging_pct"] == 0,
                )
    redis = rows(report["redis_locks"]["contended"])
    yield from history_cost(redis, "redis", "contended", "ops_per_s", slower=False)
    ours, peer = redis.get(f"djlocks redis{OFF}"), redis.get("python-redis-lock")
    if ours and peer:
        versus = ours["ops_per_s"] / peer["ops_per_s"]
        yield "contended, redis >= 1.0x python-redis-lock", f"{versus:.2f}x", versus >= 1.0


def semaphores(report: dict[str, Any]) -> Iterator[Check]:
    """Limit 3: session (and Redis) at least the raw slot-polling peer of the same run,
    leases at least 0.9x of it; never more than 3 holders."""
    redis = report["redis_locks"]["semaphore"]
    for database, run in by_database(report["database_locks"]).items():
        found = rows(run["semaphore"])
        peer = found.get(SLOTS.get(database, ""))
        for label, entry in found.items():
            if not label.startswith("djlocks"):
                continue
            yield (
                f"semaphore, {label} on {database}: at most 3 holders",
                f"at most {entry['max_concurrent']}",
                entry["max_concurrent"] <= 3,
            )
            alias = label.split()[1]
            if not label.endswith(OFF) or peer is None or alias not in SEMAPHORE_RATIO:
                continue
            versus = entry["ops_per_s"] / peer["ops_per_s"]
            yield (
                f"semaphore, {alias} on {database} >= {SEMAPHORE_RATIO[alias]}x {SLOTS[database]}",
                f"{versus:.2f}x ({entry['share_of_ideal']:.0%} of ideal)",
                versus >= SEMAPHORE_RATIO[alias],
            )
        if database == "postgresql" and peer is not None:  # Redis beside the same peer
            versus = redis["ops_per_s"] / peer["ops_per_s"]
            yield (
                f"semaphore, redis >= 1.0x {SLOTS[database]}",
                f"{versus:.2f}x ({redis['share_of_ideal']:.0%} of ideal)",
                versus >= 1.0,
            )
    yield (
        "semaphore, redis: at most 3 holders",
        f"at most {redis['max_concurrent']}",
        redis["max_concurrent"] <= 3,
    )


def render(report: dict[str, Any]) -> list[str]:
    found = list(checks(report))
    met = sum(1 for _, _, ok in found if ok)
    lines = [
        "",
        "## The targets, checked against this run",
        "",
        f"{met} of {len(found)} met. Figures with the event history off, where it matters.",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    lines += [
        f"| {target} | {measured} | {'yes' if ok else '**no**'} |" for target, measured, ok in found
    ]
    return lines


def task_queues(report: dict[str, Any]) -> Iterator[Check]:
    """``enqueue_once`` refuses every duplicate, leaves no key behind once the runs are
    done, and frees the key of a run killed with SIGKILL within its slot's TTL (plus a
    poll)."""
    run = report.get("task_queues")
    if run is None:
        return
    for row in run["dedup"]:
        if not row["contender"].startswith("djlocks"):
            continue
        freed = row["free_after_kill_s"]
        yield (
            f"{row['contender']}: every duplicate refused, nothing left behind",
            f"{row['refused']}/{row['keys']} refused, {row['left_behind']} left",
            row["refused"] == row["keys"] and row["left_behind"] == 0,
        )
        yield (
            f"{row['contender']}: a run killed with SIGKILL frees its key <= TTL + 0.5 s "
            f"({run['ttl_s'] + 0.5} s)",
            "never" if freed is None else f"{freed} s",
            freed is not None and freed <= run["ttl_s"] + 0.5,
        )
