"""Every system check id: the settings' own, and each backend's (``LockBackend.check``).

Checks that need a server in a state the shared test servers must not take
(Galera, statement-based binary logging, innodb_rollback_on_timeout) run
``manage.py check`` against a private MariaDB started that way; the Redis ids
are in test_redis_backend.py and E009 in test_session_backends.py (PgBouncer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core import checks
from django.db import connection
from django.db.utils import ConnectionHandler
from django.test import override_settings

from djlocks import Lock
from djlocks.backends import backends, import_hint
from djlocks.backends.redis import RedisBackend
from djlocks.backends.sqlite_checks import lease_store_messages
from djlocks.checks import check_backends
from djlocks.stress import current_database_names
from tests.faults import PrivateMariaDB
from tests.processes import manage

LEASE = "djlocks.backends.lease.LeaseBackend"
REDIS = "djlocks.backends.redis.RedisBackend"


def _ids() -> set[str]:
    return {
        message.id
        for message in checks.run_checks(include_deployment_checks=False, databases=["default"])
        if message.id and not message.is_silenced()
    }


def _sqlite(name: str, **options: object) -> ConnectionHandler:
    """Real SQLite connections to ``name``, outside the project's DATABASES."""
    return ConnectionHandler(
        {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": name, "OPTIONS": options}}
    )


@pytest.mark.django_db
def test_the_project_passes_its_checks() -> None:
    assert not {i for i in _ids() if i.startswith("djlocks.")}


@override_settings(DJLOCKS={"BACKENDS": {}})
def test_empty_backends_is_an_error() -> None:
    assert "djlocks.E001" in _ids()


@override_settings(DJLOCKS={"BACKENDS": {"default": {"BACKEND": "djlocks.backends.nope.X"}}})
def test_unimportable_backend_is_an_error() -> None:
    assert "djlocks.E002" in _ids()


def test_a_missing_driver_names_the_extra_to_install() -> None:
    assert import_hint(ModuleNotFoundError("No module named 'redis'", name="redis")) == (
        "Install the driver with: pip install 'djlocks[redis]'."
    )
    assert "djlocks[mysql]" in str(import_hint(ModuleNotFoundError(name="MySQLdb")))
    assert "djlocks[postgresql]" in str(import_hint(ModuleNotFoundError(name="psycopg.pq")))
    assert import_hint(ModuleNotFoundError(name="nope")) is None


@pytest.mark.django_db
@override_settings(DJLOCKS={"TTL": 0})
def test_bad_ttl_is_an_error() -> None:
    assert "djlocks.E003" in _ids()


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [("TTL", 0, ValueError), ("TTL", "a minute", TypeError), ("MAX_HOLD", -5, ValueError)],
)
def test_a_bad_default_named_by_no_argument_names_its_setting(
    key: str, value: object, error: type[Exception]
) -> None:
    """A lock given no ``ttl`` (or ``max_hold``) reads ``DJLOCKS``: the error says so."""
    with override_settings(DJLOCKS={key: value}), pytest.raises(error) as raised:
        Lock("checks:defaults").acquire(timeout=0)
    assert str(raised.value).startswith(f"DJLOCKS[{key!r}] in your settings: "), raised.value


@pytest.mark.django_db
@pytest.mark.parametrize("max_hold", [0, -5, "an hour"])
def test_bad_max_hold_is_an_error(max_hold: object) -> None:
    with override_settings(DJLOCKS={"MAX_HOLD": max_hold}):
        assert "djlocks.E011" in _ids()


@pytest.mark.django_db
@pytest.mark.parametrize("idle", [0, 60, -1, "a day"])
def test_a_bad_idle_time_of_names_is_an_error(idle: object) -> None:
    with override_settings(DJLOCKS={"SWEEP_IDLE_NAMES": idle}):
        assert "djlocks.E013" in _ids()
    with override_settings(DJLOCKS={"SWEEP_IDLE_NAMES": 86400}):
        assert "djlocks.E013" not in _ids()


@pytest.mark.django_db
@pytest.mark.parametrize("grouping", ["no.such.module.group", "djlocks.metrics.LABELS"])
def test_a_metrics_group_that_is_not_a_function_is_an_error(grouping: str) -> None:
    with override_settings(DJLOCKS={"METRICS_GROUP": grouping}):
        assert "djlocks.E012" in _ids()
    with override_settings(DJLOCKS={"METRICS_GROUP": "djlocks.metrics.name_group"}):
        assert "djlocks.E012" not in _ids()


@override_settings(
    DJLOCKS={
        "BACKENDS": {"default": {"BACKEND": LEASE, "OPTIONS": {"using": "default"}}},
        "TTLL": 30,
    }
)
def test_a_misspelled_setting_is_named_with_a_suggestion() -> None:
    [warning] = [m for m in checks.run_checks() if m.id == "djlocks.W006"]
    assert "'TTLL'" in warning.msg and warning.hint == "Did you mean 'TTL'?"


@override_settings(
    DJLOCKS={"BACKENDS": {"default": {"BACKEND": LEASE, "OPTION": {"using": "default"}}}}
)
def test_a_misspelled_backend_key_is_named_with_a_suggestion() -> None:
    [warning] = [m for m in checks.run_checks() if m.id == "djlocks.W006"]
    assert "'OPTION'" in warning.msg and warning.hint == "Did you mean 'OPTIONS'?"


@pytest.mark.parametrize(
    ("backend", "options", "meant"),
    [
        (LEASE, {"using": "default", "usign": "other"}, "using"),
        (REDIS, {"cache": "default", "wait_replica": 1}, "wait_replicas"),
        (REDIS, {"cache": "default", "prefx": "locks"}, "prefix"),
    ],
)
def test_a_misspelled_option_is_named_with_a_suggestion(
    backend: str, options: dict[str, object], meant: str
) -> None:
    (wrong,) = set(options) - {"using", "cache"}
    with override_settings(
        DJLOCKS={"BACKENDS": {"default": {"BACKEND": LEASE}, "other": {"BACKEND": backend,
                                                                       "OPTIONS": options}}}
    ):  # fmt: skip
        [warning] = [m for m in checks.run_checks() if m.id == "djlocks.W006"]
    assert f"'OPTIONS'] has a key djlocks does not know: {wrong!r}" in warning.msg
    assert warning.hint == f"Did you mean {meant!r}?"


class ReadsMore(RedisBackend):
    """A project's subclass that reads an option of its own and declares none."""


class DeclaresMore(RedisBackend):
    option_names = RedisBackend.option_names | {"endpoint"}


@pytest.mark.parametrize("subclass", [ReadsMore, DeclaresMore])
def test_a_subclass_is_checked_only_by_what_it_declares(subclass: type[RedisBackend]) -> None:
    path = f"{__name__}.{subclass.__name__}"
    options = {"cache": "default", "endpoint": "x"}
    with override_settings(
        DJLOCKS={"BACKENDS": {"default": {"BACKEND": LEASE}, "own": {"BACKEND": path,
                                                                     "OPTIONS": options}}}
    ):  # fmt: skip
        assert "djlocks.W006" not in {m.id for m in checks.run_checks()}
        with override_settings(
            DJLOCKS={"BACKENDS": {"default": {"BACKEND": LEASE}, "own": {"BACKEND": path,
                                          "OPTIONS": {**options, "wait_replica": 1}}}}
        ):  # fmt: skip
            warned = "djlocks.W006" in {m.id for m in checks.run_checks()}
            assert warned is (subclass is DeclaresMore)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"cache": "default", "cluster": "redis://127.0.0.1:7000/0"}, "not both"),
        ({"cluster": "redis://127.0.0.1:7000/1"}, "database 0 only"),
        ({"cluster": []}, "non-empty list"),
        ({"cache": "default", "wait_timeout": 0}, "wait_timeout"),
        ({"cache": "default", "prefix": "{locks}"}, "no braces"),
    ],
)
def test_options_a_backend_refuses_are_an_error_of_the_check(
    options: dict[str, object], said: str
) -> None:
    with override_settings(
        DJLOCKS={"BACKENDS": {"default": {"BACKEND": LEASE}, "bad": {"BACKEND": REDIS,
                                                                     "OPTIONS": options}}}
    ):  # fmt: skip
        backends.reset()
        try:
            [error] = [m for m in checks.run_checks() if m.id == "djlocks.E001"]
        finally:
            backends.reset()
    assert "'bad'" in error.msg and said in error.msg


@override_settings(
    DJLOCKS={"BACKENDS": {"default": {"BACKEND": LEASE, "OPTIONS": {"using": "missing"}}}}
)
def test_a_backend_on_an_unknown_database_is_an_error() -> None:
    assert "djlocks.E005" in _ids()


def test_a_session_backend_on_the_wrong_database_is_an_error() -> None:
    wrong = (
        "djlocks.backends.postgresql.AdvisoryLockBackend"
        if connection.vendor != "postgresql"
        else "djlocks.backends.mysql.GetLockBackend"
    )
    with override_settings(
        DJLOCKS={"BACKENDS": {"default": {"BACKEND": wrong, "OPTIONS": {"using": "default"}}}}
    ):
        assert "djlocks.E006" in _ids()


def test_leases_in_a_private_memory_database_are_an_error() -> None:
    for name in (":memory:", "file:locks?mode=memory"):
        [error] = lease_store_messages("default", _sqlite(name)["default"], None)
        assert error.id == "djlocks.E004"
        assert "use_locmem_backends" in str(error.hint), "the hint says what to do in tests"


def test_django_s_shared_memory_test_database_is_accepted() -> None:
    """One process is all a test run needs, and its connections share that database."""
    name = "file:memorydb_default?mode=memory&cache=shared"
    assert lease_store_messages("default", _sqlite(name)["default"], ["default"]) == []


@pytest.fixture
def sqlite_file(tmp_path: Path, django_db_blocker: Any) -> Iterator[Callable[..., Any]]:
    """``sqlite_file(**OPTIONS)``: a connection to a new SQLite file outside DATABASES."""
    handlers: list[ConnectionHandler] = []

    def connect(**options: object) -> Any:
        handlers.append(_sqlite(str(tmp_path / f"locks{len(handlers)}.sqlite3"), **options))
        return handlers[-1]["default"]

    with django_db_blocker.unblock():
        yield connect
    for handler in handlers:
        handler.close_all()


def test_sqlite_with_its_slow_defaults_is_warned_about(sqlite_file: Callable[..., Any]) -> None:
    store = sqlite_file()
    [warning] = lease_store_messages("default", store, ["default"])
    assert warning.id == "djlocks.W007"
    assert '"DEFERRED"' in warning.msg and '"delete"' in warning.msg
    assert "PRAGMA journal_mode=WAL" in str(warning.hint)
    [config_only] = lease_store_messages("default", store, None)
    assert "journal_mode" not in config_only.msg, "no query when Django did not ask"


def test_sqlite_with_wal_and_immediate_transactions_is_accepted(
    sqlite_file: Callable[..., Any],
) -> None:
    store = sqlite_file(transaction_mode="IMMEDIATE", init_command="PRAGMA journal_mode=WAL;")
    assert lease_store_messages("default", store, ["default"]) == []


@pytest.mark.django_db
def test_the_row_backend_on_sqlite_is_warned_about() -> None:
    ids = {message.id for message in backends["row"].check(["default"])}
    assert ids == ({"djlocks.W002"} if connection.vendor == "sqlite" else set())


@pytest.mark.django_db
def test_a_plain_check_asks_no_store() -> None:
    """``databases=None`` (plain ``check``, ``runserver``): settings only, no queries."""
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        check_backends(databases=None)
    assert len(queries) == 0


only_mariadb = pytest.mark.skipif(
    connection.vendor != "mysql",
    reason="not applicable: a MariaDB server's own settings (the mysql run checks them)",
)


def _check_against(server: PrivateMariaDB) -> str:
    """``manage.py check --database default`` with the project's MariaDB moved to
    ``server``: what it reports (standard error)."""
    check = manage(
        "check",
        "--database",
        "default",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "DJLOCKS_DB_PORT": str(server.port)},
    )
    _, report = check.communicate(timeout=120)
    return str(report)


@only_mariadb
def test_statement_binlogs_and_rollback_on_timeout_are_warned_about() -> None:
    """W001: GET_LOCK is unsafe for statement-based replication; W003: a row lock that
    times out would roll the caller's whole transaction back."""
    server = PrivateMariaDB(
        "--server-id=1",
        "--log-bin=binlog",
        "--binlog-format=STATEMENT",
        "--innodb-rollback-on-timeout=ON",
        databases=tuple(set(current_database_names().values())),
    )
    try:
        report = _check_against(server)
    finally:
        server.stop()
    assert "djlocks.W001" in report and "djlocks.W003" in report, report
    assert "djlocks.E007" not in report, report


@only_mariadb
def test_get_lock_on_galera_is_an_error() -> None:
    """E007: a Galera node (wsrep_on) does not replicate GET_LOCK."""
    server = PrivateMariaDB(
        "--wsrep-on=ON",
        "--wsrep-provider=none",
        "--binlog-format=ROW",
        databases=tuple(set(current_database_names().values())),
    )
    try:
        report = _check_against(server)
    finally:
        server.stop()
    assert "djlocks.E007" in report, report
    assert "djlocks.W001" not in report and "djlocks.W003" not in report, report


#: A process in which Django finds only psycopg2 (psycopg 3 cannot be imported): the
#: system checks of the database, then an acquire on each backend; prints what each did.
THROUGH_PSYCOPG2 = """
import json, sys
sys.modules["psycopg"] = None
from djlocks.stress import pin_database_names
pin_database_names(json.loads(sys.argv[1]))
import django
django.setup()
from django.core.checks import run_checks
from djlocks import db_lock
from djlocks.exceptions import BackendUnavailable
outcome = {"checks": [m.id + " " + m.msg for m in run_checks(databases=["default"])]}
for backend in ("default", "session", "row"):
    try:
        with db_lock("psycopg2:refused", timeout=1, backend=backend) as grant:
            outcome[backend] = f"granted fence {grant.fence}"
    except BackendUnavailable as exc:
        outcome[backend] = str(exc)
from django.db import DatabaseError, connection
from djlocks.backends.missing_table import is_missing_table
try:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM djlocks_no_such_table")
except DatabaseError as exc:
    outcome["missing table"] = is_missing_table(exc)
print(json.dumps(outcome))
"""


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="not applicable: PostgreSQL's drivers (the postgresql run)",
)
@pytest.mark.django_db(transaction=True)
def test_postgresql_through_psycopg2_is_refused_with_what_to_install() -> None:
    """E015, and ``BackendUnavailable`` at the first acquire, for the lease and advisory-lock
    backends, which need psycopg 3; the row backend works through psycopg2, and so does
    the history (a missing table is told apart, for the advice to migrate)."""
    done = subprocess.run(
        [sys.executable, "-c", THROUGH_PSYCOPG2, json.dumps(current_database_names())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.splitlines()[-1])
    refusals = sorted(c for c in outcome["checks"] if c.startswith("djlocks.E015"))
    assert refusals == [
        f"djlocks.E015 djlocks backend {alias!r} needs psycopg 3 on PostgreSQL, but Django "
        f"talks to database 'default' through psycopg2."
        for alias in ("default", "session")
    ], outcome["checks"]
    for alias in ("default", "session"):
        assert outcome[alias].startswith(f"djlocks backend {alias!r} needs psycopg 3"), outcome
        assert "pip install 'djlocks[postgresql]'" in outcome[alias]
    assert outcome["row"].startswith("granted fence"), outcome
    assert outcome["missing table"] is True, "psycopg2's error for a missing table is told apart"


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="not applicable: PostgreSQL's drivers (the postgresql run)",
)
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("backend", "options"),
    [("default", ["--standby"]), ("session", ["--standby"]), ("session", [])],
    ids=["lease-standby", "session-standby", "session-at-the-acquire"],
)
def test_runlocked_through_psycopg2_exits_unavailable_with_what_to_install(
    backend: str, options: list[str]
) -> None:
    """A backend refused as runlocked sets it up (``--standby`` runs the backend's
    configuration checks, and asks the lease backend what it can hold: a standby
    would otherwise wait the refusal out forever) or at the acquire: exit status 69
    with the reason, never a traceback."""
    hidden = "import sys; sys.modules['psycopg'] = None; import djlocks.stress as s; s.manage()"
    done = subprocess.run(
        [sys.executable, "-c", hidden, json.dumps(current_database_names()), "runlocked",
         "psycopg2:refused", *options, "--backend", backend, "--", "true"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 69, done.stderr[-3000:]
    assert f"djlocks backend {backend!r} needs psycopg 3" in done.stderr, done.stderr
    assert "pip install 'djlocks[postgresql]'" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
