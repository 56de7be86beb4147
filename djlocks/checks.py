"""System checks (ids ``djlocks.E001``...): malformed settings, unknown backends,
and a lease backend that other processes could not see."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from django.core import checks
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.utils.module_loading import import_string

from djlocks.conf import djlocks_settings
from djlocks.exceptions import BackendUnavailable


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001 BACKENDS malformed; E002 BACKEND path not importable; E003 TTL invalid."""
    configured = djlocks_settings()
    errors: list[CheckMessage] = []
    aliases = configured["BACKENDS"]
    if not isinstance(aliases, dict) or not aliases:
        return [
            Error(
                "DJLOCKS['BACKENDS'] must be a non-empty dict of alias -> backend spec.",
                hint="See the README: {'default': {'BACKEND': "
                "'djlocks.backends.lease.LeaseBackend', 'OPTIONS': {'using': 'default'}}}.",
                id="djlocks.E001",
            )
        ]
    for alias, spec in aliases.items():
        if not isinstance(spec, dict) or "BACKEND" not in spec:
            errors.append(
                Error(
                    f"DJLOCKS['BACKENDS'][{alias!r}] must be a dict with a 'BACKEND' key.",
                    hint="Give the dotted path of a backend class, as in CACHES.",
                    id="djlocks.E001",
                )
            )
            continue
        try:
            import_string(spec["BACKEND"])
        except ImportError as exc:
            errors.append(
                Error(
                    f"DJLOCKS['BACKENDS'][{alias!r}]['BACKEND'] cannot be imported: {exc}",
                    hint="Check the dotted path, e.g. 'djlocks.backends.lease.LeaseBackend'.",
                    id="djlocks.E002",
                )
            )
    ttl = configured["TTL"]
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0.3 <= ttl < float("inf"):
        errors.append(
            Error(
                f"DJLOCKS['TTL'] must be a finite number of seconds >= 0.3, not {ttl!r}.",
                hint="The default is 60.",
                id="djlocks.E003",
            )
        )
    return errors


@register(Tags.database)
def check_lease_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E004: a lease backend on an in-memory SQLite database, invisible to other processes."""
    errors: list[CheckMessage] = []
    for alias, spec in djlocks_settings()["BACKENDS"].items():
        if not isinstance(spec, dict) or not str(spec.get("BACKEND", "")).endswith("LeaseBackend"):
            continue
        using = spec.get("OPTIONS", {}).get("using", "default")
        if using not in connections:
            errors.append(
                Error(
                    f"djlocks backend {alias!r} uses database {using!r}, which is not in "
                    "DATABASES.",
                    hint="Set OPTIONS['using'] to a database alias.",
                    id="djlocks.E005",
                )
            )
            continue
        connection = connections[using]
        database_name = str(connection.settings_dict["NAME"])
        in_memory = database_name == ":memory:" or "mode=memory" in database_name
        if connection.vendor == "sqlite" and in_memory:
            errors.append(
                Error(
                    f"djlocks backend {alias!r} keeps its leases in an in-memory SQLite "
                    f"database ({using!r}); other processes cannot see it, so it locks nothing.",
                    hint="Use a file database (NAME = a path), with WAL and a busy timeout.",
                    id="djlocks.E004",
                )
            )
    return errors


@register(Tags.database)
def check_session_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E006 a session backend on the wrong database; E007 GET_LOCK under Galera;
    W001 GET_LOCK with statement-based binary logging; E009 server sessions shared
    between clients by a pooler (PgBouncer in transaction pooling mode)."""
    from djlocks.backends.session import SessionBackend

    messages: list[CheckMessage] = []
    for alias, backend_class, using in _configured(SessionBackend):
        connection = connections[using]
        if connection.vendor != backend_class.vendor:
            messages.append(
                Error(
                    f"djlocks backend {alias!r} ({backend_class.__name__}) needs a "
                    f"{backend_class.vendor} database, but {using!r} is {connection.vendor}.",
                    hint="Point OPTIONS['using'] at a matching database, or use the lease "
                    "backend, which works on every database.",
                    id="djlocks.E006",
                )
            )
            continue
        if connection.vendor == "mysql":
            messages.extend(_mysql_server_warnings(alias, using))
        messages.extend(_shared_session_errors(alias))
    return messages


def _shared_session_errors(alias: str) -> list[CheckMessage]:
    from djlocks.backends import backends

    try:
        problem = backends[alias].shared_session_problem()  # type: ignore[attr-defined]
    except BackendUnavailable:
        return []  # a server that is down is reported when a lock is taken
    if problem is None:
        return []
    return [Error(problem, hint=SHARED_SESSION_HINT, id="djlocks.E009")]


def _mysql_server_warnings(alias: str, using: str) -> list[CheckMessage]:
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SHOW VARIABLES WHERE Variable_name IN ('wsrep_on', 'binlog_format', 'log_bin')"
        )
        variables = {name.lower(): str(value).upper() for name, value in cursor.fetchall()}
    messages: list[CheckMessage] = []
    if variables.get("wsrep_on") == "ON":
        messages.append(
            Error(
                f"djlocks backend {alias!r} uses GET_LOCK on a Galera cluster (wsrep_on=ON), "
                "where GET_LOCK is not replicated: two nodes would grant the same lock.",
                hint="Use the lease backend on Galera.",
                id="djlocks.E007",
            )
        )
    if variables.get("log_bin") == "ON" and variables.get("binlog_format") == "STATEMENT":
        messages.append(
            checks.Warning(
                f"djlocks backend {alias!r} uses GET_LOCK with binlog_format=STATEMENT; "
                "MySQL marks GET_LOCK unsafe for statement-based replication.",
                hint="Use binlog_format=ROW or MIXED.",
                id="djlocks.W001",
            )
        )
    return messages


@register(Tags.database)
def check_row_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W002 the row backend on SQLite; W003 innodb_rollback_on_timeout under row locks."""
    from djlocks.backends.row import RowLockBackend

    messages: list[CheckMessage] = []
    for alias, _backend_class, using in _configured(RowLockBackend):
        vendor = connections[using].vendor
        if vendor == "sqlite":
            messages.append(
                checks.Warning(
                    f"djlocks backend {alias!r} takes row locks on SQLite, which has none: "
                    f"each lock is the database's one write lock (one holder at a time, "
                    f"whatever the name), semaphores are refused, and holders, waiters and "
                    f"history are not visible.",
                    hint="Use the lease backend on SQLite, or a server database for row locks.",
                    id="djlocks.W002",
                )
            )
        elif vendor == "mysql":
            with connections[using].cursor() as cursor:
                cursor.execute("SELECT @@GLOBAL.innodb_rollback_on_timeout")
                rolls_back = bool(int(cursor.fetchone()[0]))
            if rolls_back:
                messages.append(
                    checks.Warning(
                        f"djlocks backend {alias!r}: innodb_rollback_on_timeout is ON, so a "
                        f"row lock that times out rolls the caller's whole transaction back.",
                        hint="Turn innodb_rollback_on_timeout off (the default).",
                        id="djlocks.W003",
                    )
                )
    return messages


@register(Tags.database)
def check_redis_stores(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E008 the Redis backend on a cache that is not django-redis; W004 an eviction policy
    that may delete leases; W005 Redis cannot be reached."""
    from redis.exceptions import ResponseError

    from djlocks.backends import backends
    from djlocks.backends.redis import RedisBackend

    messages: list[CheckMessage] = []
    for alias, _backend_class, _options in _configured_options(RedisBackend):
        try:
            client = cast(RedisBackend, backends[alias]).redis()
            policy = client.config_get("maxmemory-policy").get("maxmemory-policy", "noeviction")
        except ImproperlyConfigured as exc:
            messages.append(Error(str(exc), hint=REDIS_CACHE_HINT, id="djlocks.E008"))
            continue
        except ResponseError:
            continue  # CONFIG is disabled (managed Redis): the policy cannot be read
        except Exception as exc:
            messages.append(
                checks.Warning(
                    f"djlocks backend {alias!r} cannot reach Redis: {exc}",
                    hint="Start redis-server, or fix the cache's LOCATION.",
                    id="djlocks.W005",
                )
            )
            continue
        if policy != "noeviction":
            messages.append(
                checks.Warning(
                    f"djlocks backend {alias!r}: Redis evicts keys (maxmemory-policy={policy}) "
                    f"when it is full, and an evicted lease is a lock granted twice.",
                    hint="Set maxmemory-policy noeviction, or give locks a Redis of their own.",
                    id="djlocks.W004",
                )
            )
    return messages


SHARED_SESSION_HINT = (
    "Session locks need a server session of their own: connect directly, or through a "
    "PgBouncer pool with pool_mode = session."
)
REDIS_CACHE_HINT = (
    "Point OPTIONS['cache'] at a CACHES alias whose BACKEND is 'django_redis.cache.RedisCache'."
)


def _configured_options(base: type) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(alias, backend class, OPTIONS) of each configured backend of class ``base``.

    Backends that cannot be imported are left to ``check_settings``.
    """
    for alias, spec in djlocks_settings()["BACKENDS"].items():
        try:
            backend_class = import_string(spec["BACKEND"])
        except (ImportError, KeyError, TypeError):
            continue
        if isinstance(backend_class, type) and issubclass(backend_class, base):
            yield alias, backend_class, spec.get("OPTIONS", {})


def _configured(base: type) -> Iterator[tuple[str, Any, str]]:
    """(alias, backend class, database alias) of each configured backend of class ``base``.

    An unknown database alias is left to Django's own checks.
    """
    for alias, backend_class, options in _configured_options(base):
        using = options.get("using", "default")
        if using in connections:
            yield alias, backend_class, using
