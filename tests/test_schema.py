"""djlocks' tables, as migrated on the database under test."""

from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db

#: The tables whose rows change their token at every grant (a claim, a release, a
#: holder's row).
TOKEN_TABLES = ("djlocks_lease_slot", "djlocks_session_holder", "djlocks_row_holder")


@pytest.mark.parametrize("table", TOKEN_TABLES)
def test_a_token_has_one_index_its_unique_constraint(table: str) -> None:
    """A row whose token changes writes every index on the column: one is all the
    lookups by token use. ``unique=True`` on the field would add, on PostgreSQL, an
    index for ``LIKE`` (``varchar_pattern_ops``) that no query uses."""
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
    on_token = [c for c in constraints.values() if c["columns"] == ["token"]]
    assert len(on_token) == 1, on_token
    assert on_token[0]["unique"]
