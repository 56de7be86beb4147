"""The test project with a read replica: ``DJLOCKS_REPLICA_PORT`` is the replica's port
on the same host, and a router sends every read there and every write to the primary,
as projects that scale reads out do. The lock backends name no database (no
``OPTIONS["using"]``), so the router picks theirs."""

from __future__ import annotations

import os
from typing import Any

from project.settings import *  # noqa: F403
from project.settings import DATABASES, DJLOCKS

DATABASES["replica"] = {**DATABASES["default"], "PORT": os.environ["DJLOCKS_REPLICA_PORT"]}
DATABASE_ROUTERS = ["tests.replica_settings.ReadsFromTheReplica"]
for spec in DJLOCKS["BACKENDS"].values():
    spec.get("OPTIONS", {}).pop("using", None)


class ReadsFromTheReplica:
    """Reads from the replica, writes and migrations on the primary."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default"
