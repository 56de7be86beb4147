"""The runlocked start-up workload on one database: ``manage.py runlocked`` against
Django's start-up.

Wall time of ``manage.py runlocked NAME --backend ALIAS -- true`` (start
Django, acquire, start the command, wait for it, release, exit) beside
``manage.py version`` (start Django, print, exit), the runs interleaved; the
ratio of the medians is the figure.

Usage: DJLOCKS_DB=sqlite|postgresql|mysql python bench/runlocked_startup.py [--quick]
Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def wall_seconds(arguments: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "manage.py", *arguments],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings"},
    )
    return time.perf_counter() - began


def run(repetitions: int) -> dict[str, Any]:
    database = os.environ.get("DJLOCKS_DB", "sqlite")
    aliases = ["default"] if database == "sqlite" else ["default", "session"]
    commands = {"version": ["version"]} | {
        alias: ["runlocked", "bench:runlocked", "--backend", alias, "--", "true"]
        for alias in aliases
    }
    times: dict[str, list[float]] = {label: [] for label in commands}
    for arguments in commands.values():  # warm-up: file caches, compiled bytecode
        wall_seconds(arguments)
    for _ in range(repetitions):
        for label, arguments in commands.items():
            times[label].append(wall_seconds(arguments))
    version = statistics.median(times["version"])
    return {
        "database": database,
        "version_s": round(version, 3),
        "runlocked": [
            {
                "backend": alias,
                "median_s": round(statistics.median(times[alias]), 3),
                "x_version": round(statistics.median(times[alias]) / version, 2),
            }
            for alias in aliases
        ],
    }


if __name__ == "__main__":
    print(json.dumps(run(5 if "--quick" in sys.argv else 20)))
