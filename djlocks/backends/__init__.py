"""Backends are chosen by alias from ``DJLOCKS["BACKENDS"]``, like ``CACHES``."""

from __future__ import annotations

import atexit
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from djlocks.backends.base import LockBackend
from djlocks.conf import djlocks_settings
from djlocks.forksafe import fork_safe_lock


class BackendHandler:
    """Builds each configured backend once per process and hands it out by alias."""

    def __init__(self) -> None:
        self._lock = fork_safe_lock()
        self._backends: dict[str, LockBackend] = {}
        self._built_from: dict[str, Any] | None = None  # DJLOCKS["BACKENDS"] they came from

    def __getitem__(self, alias: str) -> LockBackend:
        backend = self._backends.get(alias)
        if backend is None:
            with self._lock:
                backend = self._backends.get(alias) or self._build(alias)
                self._backends[alias] = backend
                self._built_from = djlocks_settings()["BACKENDS"]
        return backend

    def _build(self, alias: str) -> LockBackend:
        configured = djlocks_settings()["BACKENDS"]
        if alias not in configured:
            known = ", ".join(sorted(configured)) or "none"
            raise ImproperlyConfigured(
                f"No djlocks backend is configured under the alias {alias!r} "
                f"(configured: {known}). Add it to DJLOCKS['BACKENDS']."
            )
        spec = configured[alias]
        path = spec.get("BACKEND")
        try:
            backend_class = import_string(path)
        except ImportError as exc:
            hint = import_hint(exc)
            raise ImproperlyConfigured(
                f"DJLOCKS['BACKENDS'][{alias!r}]['BACKEND'] = {path!r} cannot be imported: "
                f"{exc}.{' ' + hint if hint else ''}"
            ) from exc
        backend: LockBackend = backend_class(alias, spec.get("OPTIONS", {}))
        return backend

    def aliases(self) -> list[str]:
        return list(djlocks_settings()["BACKENDS"])

    def reset(self) -> None:
        """Write the history and holder records handed to the background writers, then
        forget every backend and close every connection they opened, in every thread.

        A thread still ending an aborted wait's statement is waited for first, up to
        ``aside.RESET_WAIT`` seconds; a statement another thread still runs on a
        connection is cancelled before the connection is closed
        (``DedicatedConnections.close_all``)."""
        from djlocks.backends import aside
        from djlocks.backends.dedicated import DedicatedConnections
        from djlocks.backends.server_records import holder_records
        from djlocks.events import events

        events.flush()
        holder_records.flush()
        self.stop_listeners()
        aside.wait_for_all()
        DedicatedConnections.close_all()

    def stop_listeners(self) -> None:
        """Forget every backend and stop what each runs in the background (its listener
        threads), leaving its connections open.

        Run at interpreter exit, so that no listener (a daemon thread) is caught inside
        a store's client when the interpreter finalises. The connections are left to
        the operating system: closing one while another thread's statement still runs
        on it can crash the exiting process (it did on SQLite under Python 3.12).
        """
        with self._lock:
            built, self._backends = list(self._backends.values()), {}
            self._built_from = None
        for backend in built:
            backend.close()

    def settings_changed(self, *, setting: str, **kwargs: Any) -> None:
        """Rebuild the backends when a test changes ``DJLOCKS["BACKENDS"]`` (and only then:
        changing another key keeps every connection and listener)."""
        if setting != "DJLOCKS" or self._built_from is None:
            return
        if djlocks_settings()["BACKENDS"] != self._built_from:
            self.reset()


backends = BackendHandler()
# Connected after djlocks.conf's receiver (imported above), which re-reads DJLOCKS first.
setting_changed.connect(backends.settings_changed, dispatch_uid="djlocks.backends")
atexit.register(backends.stop_listeners)


def import_hint(exc: ImportError) -> str | None:
    """What to install when a backend's driver is missing, or ``None``."""
    extras = {
        "redis": "redis",
        "django_redis": "redis",
        "MySQLdb": "mysql",
        "psycopg": "postgresql",
    }
    missing = (getattr(exc, "name", None) or "").partition(".")[0]
    if missing not in extras:
        return None
    return f"Install the driver with: pip install 'djlocks[{extras[missing]}]'."
