"""The benchmark's targets, each checked against the figures of one ``make bench`` run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

OFF = " (history off)"
ON = " (history on)"
RAW = {"mysql": "raw GET_LOCK / RELEASE_LOCK", "postgresql": "raw pg_advisory_lock / unlock"}
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
    limits = {"session": {"mysql": 2.8, "postgresql": 2.6}, "default": 4.0, "row": 4.0}
    for database, run in by_database(report["uncontended"]).items():
        if database not in SERVERS:
            continue
        found = rows(run["results"])
        for alias, limit in limits.items():
            entry = found.get(f"djlocks {alias}{OFF}")
            bound = limit[database] if isinstance(limit, dict) else limit
            if entry is not None:
                yield (
                    f"uncontended, {alias} on {database} <= {bound} x RTT",
                    f"{entry['x_rtt']} x RTT",
                    entry["x_rtt"] <= bound,
                )
        yield from history_cost(found, database, "uncontended", "median_us", slower=True)
    redis = rows(report["redis_locks"]["uncontended"])
    yield from history_cost(redis, "redis", "uncontended", "median_us", slower=True)
    off = redis.get(f"djlocks redis{OFF}")
    if off is not None:
        yield "uncontended, redis <= 3.0 x RTT", f"{off['x_rtt']} x RTT", off["x_rtt"] <= 3.0


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
    handoff_limits = {"session": 0.5, "default": {"postgresql": 2.0, "mysql": 5.0, "sqlite": 5.0}}
    for database, run in by_database(report["database_locks"]).items():
        found = rows(run["contended"])
        yield from history_cost(found, database, "contended", "ops_per_s", slower=False)
        raw = found.get(RAW.get(database, ""))
        for alias, ratio in (("session", 0.9), ("default", 0.6)):
            entry = found.get(f"djlocks {alias}{OFF}")
            if entry is None:
                continue
            if raw is not None:
                versus = entry["ops_per_s"] / raw["ops_per_s"]
                yield (
                    f"contended, {alias} on {database} >= {ratio}x the raw primitive",
                    f"{versus:.2f}x",
                    versus >= ratio,
                )
            limit = handoff_limits[alias]
            bound = limit[database] if isinstance(limit, dict) else limit
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
        yield (
            "hand-off median, redis <= 0.5 ms",
            f"{ours['handoff_ms_p50']} ms",
            ours["handoff_ms_p50"] <= 0.5,
        )


def semaphores(report: dict[str, Any]) -> Iterator[Check]:
    for database, run in by_database(report["database_locks"]).items():
        for label, entry in rows(run["semaphore"]).items():
            if label.startswith("djlocks") and label.endswith(OFF):
                yield (
                    f"semaphore, {label.removesuffix(OFF)} on {database} >= 90 % of ideal, <= 3",
                    f"{entry['share_of_ideal']:.0%} (lone ceiling {entry['lone_ceiling']:.0%}), "
                    f"at most {entry['max_concurrent']}",
                    entry["share_of_ideal"] >= 0.9 and entry["max_concurrent"] <= 3,
                )
    redis = report["redis_locks"]["semaphore"]
    yield (
        "semaphore, redis >= 90 % of ideal, <= 3",
        f"{redis['share_of_ideal']:.0%}, at most {redis['max_concurrent']}",
        redis["share_of_ideal"] >= 0.9 and redis["max_concurrent"] <= 3,
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
