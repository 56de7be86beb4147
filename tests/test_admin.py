from __future__ import annotations

import pytest
from django.test import Client

from djlocks import db_lock, db_semaphore

pytestmark = pytest.mark.usefixtures("store")


def test_admin_lists_holders_and_is_read_only(admin_client: Client) -> None:
    with (
        db_lock("admin:lock", label="nightly import", timeout=0),
        db_semaphore("admin:sem", limit=3, timeout=0),
    ):
        page = admin_client.get("/admin/djlocks/leaseslot/").content.decode()
        assert "admin:lock" in page and "nightly import" in page and "admin:sem" in page
        assert admin_client.get("/admin/djlocks/leaseslot/add/").status_code == 403
