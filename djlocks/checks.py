"""System checks: the ``DJLOCKS`` setting itself here, each configured backend's
store through its own ``LockBackend.check``.

Here: E001 ``BACKENDS`` malformed, E002 a backend that cannot be imported, E003 a
bad ``TTL``, E010 an unknown ``EVENTS_WRITER``, E011 a bad ``MAX_HOLD``, E012 a
``METRICS_GROUP`` that is not a function, E013 a bad ``SWEEP_IDLE_NAMES``, W006 an
unknown key. The backends': E004
leases in an in-memory SQLite database, W007 SQLite without WAL or ``IMMEDIATE``
transactions (lease); E005 an unknown database alias, E006 a database the backend
cannot use (every database backend); E007 GET_LOCK under Galera, W001
statement-based binary logging (GET_LOCK); E009 a pooler that shares server sessions (session
backends); W002 row locks on SQLite, W003 ``innodb_rollback_on_timeout`` (row); E008
a cache that is not django-redis, W004 an eviction policy that may drop leases, W005
a Redis that cannot be reached, W008 fewer replicas than ``wait_replicas`` (Redis);
E014 a read-only database (every database backend); E015 PostgreSQL through psycopg2
(lease, advisory locks).
Each id has a section in the troubleshooting page of the docs.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any

from django.core import checks
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from djlocks.arguments import normalize_idle_names, normalize_max_hold
from djlocks.backends import import_hint
from djlocks.conf import BACKGROUND, DEFAULTS, SYNCHRONOUS, djlocks_settings

BACKEND_SPEC_KEYS = ("BACKEND", "OPTIONS")
#: What a backend's constructor raises for ``OPTIONS`` it cannot use.
BUILD_ERRORS = (ImproperlyConfigured, TypeError, ValueError)


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001 BACKENDS malformed; E002 BACKEND path not importable; E003 TTL invalid;
    E010 EVENTS_WRITER unknown; E011 MAX_HOLD invalid; E012 METRICS_GROUP not a
    function; E013 SWEEP_IDLE_NAMES invalid; W006 a key djlocks does not know (a
    misspelling is otherwise silently ignored), also in a backend's ``OPTIONS``; E001
    also for ``OPTIONS`` a backend refuses."""
    configured = djlocks_settings()
    messages = _unknown_keys("DJLOCKS", configured, DEFAULTS)
    aliases = configured["BACKENDS"]
    if not isinstance(aliases, dict) or not aliases:
        return [
            *messages,
            Error(
                "DJLOCKS['BACKENDS'] must be a non-empty dict of alias -> backend spec.",
                hint="For example {'default': {'BACKEND': "
                "'djlocks.backends.lease.LeaseBackend', 'OPTIONS': {'using': 'default'}}}.",
                id="djlocks.E001",
            ),
        ]
    for alias, spec in aliases.items():
        if not isinstance(spec, dict) or "BACKEND" not in spec:
            messages.append(
                Error(
                    f"DJLOCKS['BACKENDS'][{alias!r}] must be a dict with a 'BACKEND' key.",
                    hint="Give the dotted path of a backend class, as in CACHES.",
                    id="djlocks.E001",
                )
            )
            continue
        messages.extend(_unknown_keys(f"DJLOCKS['BACKENDS'][{alias!r}]", spec, BACKEND_SPEC_KEYS))
        try:
            backend_class = import_string(spec["BACKEND"])
        except ImportError as exc:
            messages.append(
                Error(
                    f"DJLOCKS['BACKENDS'][{alias!r}]['BACKEND'] cannot be imported: {exc}",
                    hint=import_hint(exc)
                    or "Check the dotted path, e.g. 'djlocks.backends.lease.LeaseBackend'.",
                    id="djlocks.E002",
                )
            )
            continue
        known = _declared_options(backend_class)
        options = spec.get("OPTIONS", {})
        if known is not None and isinstance(options, dict):
            where = f"DJLOCKS['BACKENDS'][{alias!r}]['OPTIONS']"
            messages.extend(_unknown_keys(where, options, known))
        messages.extend(_refused_options(alias))
    ttl = configured["TTL"]
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0.3 <= ttl < float("inf"):
        messages.append(
            Error(
                f"DJLOCKS['TTL'] must be a finite number of seconds >= 0.3, not {ttl!r}.",
                hint="The default is 60.",
                id="djlocks.E003",
            )
        )
    for key, normalize, hint, error in (
        (
            "MAX_HOLD",
            normalize_max_hold,
            "Seconds (more than 0), or None (the default) for no bound.",
            "djlocks.E011",
        ),
        (
            "SWEEP_IDLE_NAMES",
            normalize_idle_names,
            "Seconds (at least 120), or None (the default) to keep every name.",
            "djlocks.E013",
        ),
    ):
        try:
            normalize(configured[key])
        except (TypeError, ValueError) as exc:
            messages.append(Error(f"DJLOCKS[{key!r}] is invalid: {exc}", hint=hint, id=error))
    grouping = configured["METRICS_GROUP"]
    if grouping is not None:
        try:
            if not isinstance(grouping, str) or not callable(import_string(grouping)):
                raise ImportError(f"{grouping!r} is not the dotted path of a function")
        except ImportError as exc:
            messages.append(
                Error(
                    f"DJLOCKS['METRICS_GROUP'] must be the dotted path of a function that "
                    f"takes a lock's name and returns its group: {exc}",
                    hint="Leave it None to group names by the part before their first ':'.",
                    id="djlocks.E012",
                )
            )
    writer = configured["EVENTS_WRITER"]
    if writer not in (BACKGROUND, SYNCHRONOUS):
        messages.append(
            Error(
                f"DJLOCKS['EVENTS_WRITER'] must be {BACKGROUND!r} or {SYNCHRONOUS!r}, "
                f"not {writer!r}.",
                hint=f"{BACKGROUND!r} (the default) writes the history on a background "
                f"thread; {SYNCHRONOUS!r} before each lock operation returns.",
                id="djlocks.E010",
            )
        )
    return messages


@register(Tags.database)
def check_backends(
    app_configs: Any = None, databases: Collection[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Each configured backend's own messages (``LockBackend.check``).

    Stores are queried only for the ``databases`` Django asks about (``migrate``,
    ``test``, ``check --database``); a plain ``check`` looks at the settings alone.
    A backend that cannot be imported or built is left to ``check_settings``.
    """
    from djlocks.backends import backends

    messages: list[CheckMessage] = []
    for alias, spec in _backend_specs():
        try:
            import_string(spec["BACKEND"])
            backend = backends[alias]
        except (ImportError, *BUILD_ERRORS):
            continue
        messages.extend(backend.check(databases))
    return messages


def _refused_options(alias: str) -> list[CheckMessage]:
    """E001 if the backend ``alias`` refuses its ``OPTIONS`` (its constructor raises),
    with the backend's own message; built here, in the checks every ``check`` runs,
    not only in those of databases."""
    from djlocks.backends import backends

    try:
        backends[alias]
    except BUILD_ERRORS as exc:
        hint = "Fix the backend's OPTIONS as the message says."
        return [Error(str(exc), hint=hint, id="djlocks.E001")]
    return []


def _declared_options(backend_class: Any) -> Collection[str] | None:
    """The ``OPTIONS`` keys a backend class declares it reads (``option_names``): those
    of djlocks' own backends, and of any class that declares them itself. A subclass
    from elsewhere that declares none may read more than its parent: not checked."""
    if "option_names" in vars(backend_class) or backend_class.__module__.startswith("djlocks."):
        known: Collection[str] | None = getattr(backend_class, "option_names", None)
        return known
    return None


def _backend_specs() -> list[tuple[str, dict[str, Any]]]:
    aliases = djlocks_settings()["BACKENDS"]
    if not isinstance(aliases, dict):
        return []
    return [(a, s) for a, s in aliases.items() if isinstance(s, dict) and "BACKEND" in s]


def _unknown_keys(where: str, given: dict[str, Any], known: Collection[str]) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    for key in sorted(set(given) - set(known), key=str):
        close = difflib.get_close_matches(str(key), list(known), n=1)
        messages.append(
            checks.Warning(
                f"{where} has a key djlocks does not know: {key!r}; it is ignored.",
                hint=f"Did you mean {close[0]!r}?"
                if close
                else f"The known keys are {', '.join(sorted(known))}."
                if known
                else "It takes none.",
                id="djlocks.W006",
            )
        )
    return messages
