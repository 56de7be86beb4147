"""``make bench``: run the workloads on every database, write docs/benchmarks.md and JSON.

Each workload script runs in its own process per database (the project picks
its database with ``DJLOCKS_DB``) and prints one JSON document; this collects
them into ``docs/benchmarks.json`` and renders ``docs/benchmarks.md``.

Usage: python bench/run.py [--quick]
       python bench/run.py --again DATABASE WORKLOAD... (after a fix: measure these
       workloads on DATABASE again, in place of theirs in the last report, which says so;
       an earlier re-measurement that this one wholly replaces is no longer mentioned)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import targets

ROOT = Path(__file__).resolve().parent.parent
DATABASES = ("sqlite", "postgresql", "mysql")
SERVERS = ("postgresql", "mysql")
WORKLOADS = (
    "uncontended",
    "database_locks",
    "runlocked_startup",
    "dashboard_scale",
    "idle_sweep",
)
RAW = ("raw GET_LOCK / RELEASE_LOCK", "raw pg_advisory_lock / unlock")
#: Workloads that run inside private servers of their own: this command, then theirs.
AROUND = {"redis_scale": [sys.executable, "-m", "bench.private_redis"]}


def measure(workload: str, database: str, quick: bool) -> dict[str, Any]:
    command = [*AROUND.get(workload, []), sys.executable, str(ROOT / "bench" / f"{workload}.py")]
    if quick:
        command.append("--quick")
    print(f"  {workload} on {database} ...", file=sys.stderr, flush=True)
    finished = subprocess.run(
        command,
        env={**os.environ, "DJLOCKS_DB": database, "DJANGO_SETTINGS_MODULE": "bench.settings"},
        stdout=subprocess.PIPE,  # the JSON; progress and errors go straight to stderr
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, Any] = json.loads(finished.stdout.strip().splitlines()[-1])
    return result


def machine() -> dict[str, str]:
    import django

    return {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "django": django.get_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        "# djlocks benchmarks",
        "",
        f"Written by `{report['command']}` on {report['machine']['when']}: "
        f"Python {report['machine']['python']}, Django {report['machine']['django']}, "
        f"{report['machine']['machine']}. Figures are medians and ratios from one run; "
        "each section names its workload, and bench/ holds their code.",
        *(
            f"Measured again on {again['when']}, after a change: {', '.join(again['workloads'])} "
            f"on {again['database']} (each workload's contenders in one run of their own)."
            for again in report.get("again", [])
        ),
        "",
        "## Uncontended acquire + release",
        "",
        "`x RTT` is the median pair over the median `SELECT 1` round trip (the floor) "
        "measured in the same process; contenders interleaved round by round, in an order "
        "shuffled for each round.",
        "",
        "| database | floor | contender | median | p99 | x RTT |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for run in report["uncontended"]:
        for row in run["results"]:
            lines.append(
                f"| {run['database']} | {run['floor_us']} µs | {row['contender']} | "
                f"{row['median_us']} µs | {row['p99_us']} µs | {row['x_rtt']} |"
            )
    lines += render_statements(report["statements"])
    lines += render_contended(report["database_locks"])
    lines += render_runlocked(report["runlocked_startup"])
    lines += [
        "",
        "## Dashboard scale: 10,000 held names and 1,000 waiters",
        "",
        "| database | overview page | overview search | overview.json | name page "
        "| `djlocks list --json` |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in report["dashboard_scale"]:
        lines.append(
            f"| {run['database']} | {run['overview_page_s']} s | {run['overview_search_s']} s | "
            f"{run['overview_json_s']} s | {run['name_page_s']} s | {run['list_json_s']} s |"
        )
    lines += render_idle_sweep(report["idle_sweep"])
    lines += render_redis(report["redis_locks"])
    if "redis_scale" in report:
        lines += render_redis_scale(report["redis_scale"])
    lines += render_task_queues(report["task_queues"])
    lines += targets.render(report)
    return "\n".join(lines) + "\n"


def section(title: str, text: str, header: str, alignment: str) -> list[str]:
    """The opening lines of a section of docs/benchmarks.md: title, text, table header."""
    return ["", f"## {title}", "", text, "", header, alignment]


def render_idle_sweep(runs: list[dict[str, Any]]) -> list[str]:
    """The idle-name sweep: each store's size filled with names taken once, and after."""
    lines = section(
        "Sweeping idle names",
        "Distinct names taken and released once each by 4 processes; a few seconds later "
        "1,000 more; then `sweep(idle_names=...)`, its idle time ending mid-gap, removes the "
        "first set and keeps the recent one. Rows (keys on Redis) of the store's tables; "
        "the dashboard overview's time with every name, then with what is left.",
        "| database | backend | names | first use | rows before / filled / after "
        "| sweep | dashboard filled / after |",
        "|---|---|---:|---:|---|---:|---|",
    )
    for run in runs:
        for row in run["runs"]:
            lines.append(
                f"| {run['database']} | {row['backend']} ({row['store']}) | {row['names']:,} "
                f"| {row['first_use_per_s']:,}/s | {row['rows_before']:,} / "
                f"{row['rows_filled']:,} / {row['rows_after']:,} | {row['sweep_s']} s "
                f"({row['swept_per_s']:,} names/s) | {row['dashboard_filled_s']} s / "
                f"{row['dashboard_after_s']} s |"
            )
    return lines


def render_contended(runs: list[dict[str, Any]]) -> list[str]:
    """The contended lock and semaphore workloads on the databases, each contender beside
    the raw primitive."""
    lines = section(
        "Contended lock on the databases",
        "8 processes, each acquire -> read a counter row -> write it + 1 -> release. "
        + rounds_said(
            runs,
            "contended",
            "the lost updates and overlaps of every run added up and the most barging",
        )
        + "`vs raw`: ops/s over the raw primitive's (GET_LOCK, pg_advisory_lock) in the same run.",
        "| database | contender | ops/s | vs raw | lost updates | overlaps "
        "| hand-off p50 / p99 | barging | wait p99 / max |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    )
    for run in runs:
        raw = next((r for r in run["contended"] if r["contender"] in RAW), None)
        for row in run["contended"]:
            versus = f"{row['ops_per_s'] / raw['ops_per_s']:.2f}" if raw else "-"
            lines.append(
                f"| {run['database']} | {row['contender']} | {row['ops_per_s']} | {versus} | "
                f"{row['lost_updates']} | {row['overlaps']} | "
                f"{row['handoff_ms_p50']} / {row['handoff_ms_p99']} ms | "
                f"{row['barging_pct']} % | {row['wait_ms_p99']} / {row['wait_ms_max']} ms |"
            )
    lines += section(
        "Semaphore on the databases",
        "Limit 3, 8 processes, 5 ms hold; the ideal is 600 ops/s. "
        + rounds_said(runs, "semaphore", "the most holders at once of every run")
        + "The peer is the server's "
        "own lock on 3 slot keys tried in turn, sleeping 2 ms between rounds. "
        "`lone ceiling`: the share of the ideal if each slot went to the next holder at "
        "once, from one process running the same cycle (acquire, read, 5 ms, write, "
        "release) alone, in the same run: what the cycle itself costs.",
        "| database | contender | ops/s | share of ideal | lone ceiling "
        "| most holders at once | wait p99 / max |",
        "|---|---|---:|---:|---:|---:|---|",
    )
    for run in runs:
        for row in run["semaphore"]:
            lines.append(
                f"| {run['database']} | {row['contender']} | {row['ops_per_s']} | "
                f"{row['share_of_ideal']:.0%} | {row['lone_ceiling']:.0%} | "
                f"{row['max_concurrent']} | {row['wait_ms_p99']} / {row['wait_ms_max']} ms |"
            )
    return lines


def rounds_said(runs: list[dict[str, Any]], workload: str, oracles: str) -> str:
    """How many times each database's contenders ran ``workload`` (a report measured
    before the rounds has none: one run), and which run a row shows, with the
    ``oracles`` of every run."""
    by_rounds: dict[int, list[str]] = {}
    for run in runs:
        rounds = min((row.get("rounds", 1) for row in run[workload]), default=1)
        by_rounds.setdefault(rounds, []).append(run["database"])
    said = []
    for rounds, databases in sorted(by_rounds.items(), reverse=True):
        where = " and ".join(databases)
        said.append(
            f"On {where} each contender ran {rounds} times, the runs of all contenders "
            f"interleaved, and its run of median ops/s is shown, with {oracles}. "
            if rounds > 1
            else f"On {where} each contender ran once. "
        )
    return "".join(said)


def render_statements(runs: list[dict[str, Any]]) -> list[str]:
    """Round trips per uncontended acquire + release, in the caller and the background."""
    lines = section(
        "Round trips per operation",
        "One uncontended acquire + release, alone: the driver's exchanges with the server "
        "(a `BEGIN` or `COMMIT` counts) in the calling thread, and in djlocks' background "
        "writers (history, holder records: one batch serves many operations), per "
        "operation (`bench/statements.py`).",
        "| database | backend | kind | history | caller | background |",
        "|---|---|---|---|---:|---:|",
    )
    for run in runs:
        for row in run["results"]:
            lines.append(
                f"| {run['database']} | {row['backend']} | {row['kind']} | "
                f"{'on' if row['history'] else 'off'} | {row['caller']} | {row['background']} |"
            )
    return lines


def render_runlocked(runs: list[dict[str, Any]]) -> list[str]:
    """runlocked start-up: ``runlocked NAME -- true`` over ``manage.py version``."""
    lines = section(
        "runlocked start-up",
        "Median wall time of `manage.py runlocked bench:runlocked --backend ALIAS -- true` "
        "over that of `manage.py version` (Django's start-up), runs interleaved.",
        "| database | `manage.py version` | backend | runlocked | x version |",
        "|---|---:|---|---:|---:|",
    )
    for run in runs:
        for row in run["runlocked"]:
            lines.append(
                f"| {run['database']} | {run['version_s']} s | {row['backend']} | "
                f"{row['median_s']} s | {row['x_version']} |"
            )
    return lines


def render_redis(run: dict[str, Any]) -> list[str]:
    """The floor, uncontended, contended lock and semaphore workloads on Redis, djlocks
    beside redis-py's Lock and python-redis-lock."""
    lines = [
        "",
        "## Redis: djlocks beside its peers",
        "",
        f"Floor: median `PING` {run['floor_us']} µs, sampled between the batches. "
        f"Uncontended: {run['pairs']} pairs, rounds interleaved.",
        "",
        "| contender | median | p99 | x RTT |",
        "|---|---:|---:|---:|",
    ]
    for row in run["uncontended"]:
        lines.append(
            f"| {row['contender']} | {row['median_us']} µs | {row['p99_us']} µs | {row['x_rtt']} |"
        )
    peer = next(r for r in run["contended"] if r["contender"] == "python-redis-lock")
    lines += [
        "",
        "Contended lock: 8 processes, each acquire -> GET counter -> SET counter + 1 -> "
        "release. `vs prl`: ops/s over python-redis-lock's in the same run.",
        "",
        "| contender | ops/s | vs prl | lost updates | overlaps | hand-off p50 / p99 "
        "| barging | wait p99 / max |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in run["contended"]:
        lines.append(
            f"| {row['contender']} | {row['ops_per_s']} | "
            f"{row['ops_per_s'] / peer['ops_per_s']:.2f} | {row['lost_updates']} | "
            f"{row['overlaps']} | {row['handoff_ms_p50']} / {row['handoff_ms_p99']} ms | "
            f"{row['barging_pct']} % | {row['wait_ms_p99']} / {row['wait_ms_max']} ms |"
        )
    semaphore = run["semaphore"]
    lines += [
        "",
        f"Semaphore (limit 3, 8 processes, 5 ms hold; the peers have none): "
        f"{semaphore['ops_per_s']} ops/s = {semaphore['share_of_ideal']:.0%} of the 600 ops/s "
        f"ideal, at most {semaphore['max_concurrent']} holders at once.",
    ]
    return lines


def render_redis_scale(run: dict[str, Any]) -> list[str]:
    """djlocks on a Redis Cluster beside one server, and 8 to 64 processes on one store."""
    floors = run["floor_us"]
    lines = section(
        "Redis Cluster beside one server",
        "Private servers on loopback (`bench/private_redis.py`): one redis-server, and a "
        "cluster of three masters with a replica each; history off. `WAIT 1`: the backend's "
        "`wait_replicas` 1, each grant and renewal acknowledged by the master's replica. "
        f"Floors: median `PING` {floors['djlocks, one server']} µs to the server, "
        f"{floors['djlocks, cluster']} µs to the master serving the name. Contended: 8 "
        "processes, acquire -> GET -> SET -> release; semaphore: limit 3, 8 processes, 5 ms "
        "hold (ideal 600 ops/s).",
        "| contender | uncontended | x RTT | contended ops/s | hand-off p50 / p99 "
        "| semaphore ops/s | share of ideal |",
        "|---|---:|---:|---:|---|---:|---:|",
    )
    for pair, lock, semaphore in zip(
        run["uncontended"], run["contended"], run["semaphore"], strict=True
    ):
        lines.append(
            f"| {pair['contender']} | {pair['median_us']} µs | {pair['x_rtt']} | "
            f"{lock['ops_per_s']} | {lock['handoff_ms_p50']} / {lock['handoff_ms_p99']} ms | "
            f"{semaphore['ops_per_s']} | {semaphore['share_of_ideal']:.0%} |"
        )
    lines += section(
        "Redis at scale: 8 to 64 processes",
        f"One redis-server reached at {run['hosts']} loopback addresses, as from "
        f"{run['hosts']} hosts: process k connects through address k mod {run['hosts']}, "
        f"with a pool of its own. The contended lock, {run.get('operations', 1600):,} "
        "operations in all at each size; "
        "history off. `fairness`: Jain's index of the grants each process got until the "
        "first process had all of its own (1.0: all alike).",
        "| processes | contender | ops/s | hand-off p50 / p99 | barging | fairness "
        "| wait p99 | lost updates | overlaps |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|",
    )
    for row in run["scale"]:
        lines.append(
            f"| {row['processes']} | {row['contender']} | {row['ops_per_s']} | "
            f"{row['handoff_ms_p50']} / {row['handoff_ms_p99']} ms | {row['barging_pct']} % | "
            f"{row['fairness']} | {row['wait_ms_p99']} ms | {row['lost_updates']} | "
            f"{row['overlaps']} |"
        )
    return lines


def render_task_queues(run: dict[str, Any]) -> list[str]:
    """Enqueue-once beside celery-once and celery-singleton, through one Celery broker."""
    lines = [
        "",
        "## Task queues: enqueue once beside celery-once and celery-singleton",
        "",
        f"One Redis broker, the same task. Enqueue: {run['dedup'][0]['keys']} new keys with no "
        "worker running, then each again while queued (refused is right). Drain: a prefork "
        "worker with 2 pool processes runs them, the run-side work of each included; "
        "`left` counts the keys or holders still there afterwards. Killed: a run's pool "
        "process killed with SIGKILL (the OOM killer, a lost host), then seconds until its "
        f"key can be enqueued again, each library with its defaults (djlocks' slot TTL: "
        f"{run['ttl_s']} s; celery-once's key expiry: an hour; celery-singleton's: none; "
        f"`never`: still refused after {run['watch_s']:.0f} s).",
        "",
        "| contender | enqueue p50 / p99 | refuse a duplicate | refused | drain | left | killed |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in run["dedup"]:
        freed = row["free_after_kill_s"]
        killed = "never" if freed is None else "n/a" if freed == "n/a" else f"{freed} s"
        lines.append(
            f"| {row['contender']} | {row['enqueue_us']} / {row['enqueue_p99_us']} µs | "
            f"{row['duplicate_us']} µs | {row['refused']}/{row['keys']} | "
            f"{row['runs_per_s']} runs/s | {row['left_behind']} | {killed} |"
        )
    return lines


def measure_again(database: str, workloads: list[str]) -> None:
    """Measure ``workloads`` on ``database`` again, put the results in the last report in
    place of that database's, note it there, and write the report again."""
    docs = ROOT / "docs"
    report = json.loads((docs / "benchmarks.json").read_text())
    for workload in workloads:
        fresh = measure(workload, database, quick=False)
        if isinstance(report.get(workload), list):  # one result per database
            report[workload] = [
                fresh if result.get("database") == database else result
                for result in report[workload]
            ]
        else:  # measured once (Redis), with ``database`` holding only the history
            report[workload] = fresh
    superseded = [  # earlier re-measurements whose every figure this one replaced
        again
        for again in report.get("again", [])
        if again["database"] == database and set(again["workloads"]) <= set(workloads)
    ]
    report["again"] = [again for again in report.get("again", []) if again not in superseded]
    report["again"].append(
        {"database": database, "workloads": workloads, "when": machine()["when"]}
    )
    (docs / "benchmarks.json").write_text(json.dumps(report, indent=2) + "\n")
    (docs / "benchmarks.md").write_text(render(report))


def main() -> None:
    if sys.argv[1:2] == ["--again"]:
        measure_again(sys.argv[2], sys.argv[3:])
        return
    quick = "--quick" in sys.argv
    report: dict[str, Any] = {
        "command": "make bench" + (" (quick)" if quick else ""),
        "machine": machine(),
    }
    for workload in WORKLOADS:
        report[workload] = [measure(workload, database, quick) for database in DATABASES]
    # Round trips per operation: on the servers (SQLite is a file, with none to count).
    report["statements"] = [measure("statements", database, quick) for database in SERVERS]
    # Redis's own figures; the database only keeps the history of the "history on" runs.
    report["redis_locks"] = measure("redis_locks", "postgresql", quick)
    # A cluster beside one server, and 8 to 64 processes: on private Redis servers.
    report["redis_scale"] = measure("redis_scale", "postgresql", quick)
    # The task-queue peers keep their keys in Redis; djlocks' lease backend on PostgreSQL.
    report["task_queues"] = measure("task_queues", "postgresql", quick)
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "benchmarks.json").write_text(json.dumps(report, indent=2) + "\n")
    (docs / "benchmarks.md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
