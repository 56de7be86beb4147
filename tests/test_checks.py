from __future__ import annotations

import pytest
from django.core import checks
from django.test import override_settings


def _ids() -> set[str]:
    return {
        message.id
        for message in checks.run_checks(include_deployment_checks=False, databases=["default"])
        if message.id and not message.is_silenced()
    }


@pytest.mark.django_db
def test_the_project_passes_its_checks() -> None:
    assert not {i for i in _ids() if i.startswith("djlocks.")}


@override_settings(DJLOCKS={"BACKENDS": {}})
def test_empty_backends_is_an_error() -> None:
    assert "djlocks.E001" in _ids()


@override_settings(DJLOCKS={"BACKENDS": {"default": {"BACKEND": "djlocks.backends.nope.X"}}})
def test_unimportable_backend_is_an_error() -> None:
    assert "djlocks.E002" in _ids()


@override_settings(DJLOCKS={"TTL": 0})
def test_bad_ttl_is_an_error() -> None:
    assert "djlocks.E003" in _ids()


@override_settings(
    DJLOCKS={
        "BACKENDS": {
            "default": {
                "BACKEND": "djlocks.backends.lease.LeaseBackend",
                "OPTIONS": {"using": "missing"},
            }
        }
    }
)
def test_lease_backend_on_unknown_database_is_an_error() -> None:
    assert "djlocks.E005" in _ids()


def test_a_session_backend_on_the_wrong_database_is_an_error() -> None:
    from django.db import connection

    wrong = (
        "djlocks.backends.postgresql.AdvisoryLockBackend"
        if connection.vendor != "postgresql"
        else "djlocks.backends.mysql.GetLockBackend"
    )
    with override_settings(
        DJLOCKS={"BACKENDS": {"default": {"BACKEND": wrong, "OPTIONS": {"using": "default"}}}}
    ):
        assert "djlocks.E006" in _ids()


@pytest.mark.django_db
def test_the_row_backend_on_sqlite_is_warned_about() -> None:
    from django.db import connection

    from djlocks.checks import check_row_databases

    ids = {message.id for message in check_row_databases()}
    assert ids == ({"djlocks.W002"} if connection.vendor == "sqlite" else set())
