"""The dashboard scale workload: 10,000 held names and 1,000 waiters in the lease store.

Measures the server time to render the dashboard's overview (first page, and a
search) and ``djlocks list --json``. The holders and waiters are written as
store rows (live leases and live waiter records, exactly what 10,000 holders
would leave), under a name prefix that is deleted afterwards.

Usage: DJLOCKS_DB=sqlite|postgresql|mysql python bench/dashboard_scale.py
"""

from __future__ import annotations

import io
import json
import os
import secrets
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django

django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402

from djlocks.keys import table_key  # noqa: E402
from djlocks.models import LeaseSlot, LeaseWaiter  # noqa: E402

PREFIX = "bench-scale:"
NAMES = 10_000
WAITERS = 1_000
ROUNDS = 5


def populate() -> None:
    now = datetime.now(UTC)
    LeaseSlot.objects.bulk_create(
        [
            LeaseSlot(
                key=table_key(f"{PREFIX}{i:05}"),
                name=f"{PREFIX}{i:05}",
                slot=0,
                limit=1,
                token=secrets.token_hex(16),
                fence=1,
                acquired_at=now,
                expires_at=now + timedelta(hours=1),
                host="bench-host",
                pid=10_000 + i,
                label=f"job {i}",
            )
            for i in range(NAMES)
        ],
        batch_size=1000,
    )
    LeaseWaiter.objects.bulk_create(
        [
            LeaseWaiter(
                key=table_key(f"{PREFIX}{i % 100:05}"),
                name=f"{PREFIX}{i % 100:05}",
                host="bench-host",
                pid=50_000 + i,
                since=now,
                expires_at=now + timedelta(hours=1),
            )
            for i in range(WAITERS)
        ],
        batch_size=1000,
    )


def clean() -> None:
    LeaseSlot.objects.filter(name__startswith=PREFIX).delete()
    LeaseWaiter.objects.filter(name__startswith=PREFIX).delete()


def best_of(action: Any) -> float:
    times = []
    for _ in range(ROUNDS):
        began = time.perf_counter()
        action()
        times.append(time.perf_counter() - began)
    return round(min(times), 3)


def main() -> None:
    call_command("migrate", verbosity=0)
    clean()
    populate()
    user, _ = User.objects.get_or_create(username="bench-admin", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    try:

        def get(url: str) -> None:
            response = client.get(url)
            assert response.status_code == 200, response.status_code

        figures = {
            "database": django.db.connection.vendor,
            "held_names": NAMES,
            "waiters": WAITERS,
            "overview_page_s": best_of(lambda: get("/admin/djlocks/lockname/")),
            "overview_search_s": best_of(lambda: get("/admin/djlocks/lockname/?q=job+99")),
            "overview_json_s": best_of(lambda: get("/admin/djlocks/lockname/overview.json")),
            "name_page_s": best_of(
                lambda: get(f"/admin/djlocks/lockname/name/?backend=default&name={PREFIX}00001")
            ),
            "list_json_s": best_of(
                lambda: call_command("djlocks", "list", "--json", stdout=io.StringIO())
            ),
        }
    finally:
        clean()
        user.delete()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
