"""Backends are chosen by alias from ``DJLOCKS["BACKENDS"]``, like ``CACHES``."""

from __future__ import annotations

import atexit
import threading

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from djlocks.backends.base import LockBackend
from djlocks.conf import djlocks_settings


class BackendHandler:
    """Builds each configured backend once per process and hands it out by alias."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backends: dict[str, LockBackend] = {}

    def __getitem__(self, alias: str) -> LockBackend:
        backend = self._backends.get(alias)
        if backend is None:
            with self._lock:
                backend = self._backends.get(alias) or self._build(alias)
                self._backends[alias] = backend
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
        """Forget every backend and close every connection they opened, in every thread."""
        from djlocks.backends.dedicated import DedicatedConnections

        with self._lock:
            built, self._backends = list(self._backends.values()), {}
        for backend in built:
            backend.close()
        DedicatedConnections.close_all()


backends = BackendHandler()
# Listener threads are daemons: stopped before the interpreter finalises, none is caught
# inside a store's client (a daemon thread ended there can crash the exiting process).
atexit.register(backends.reset)


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
