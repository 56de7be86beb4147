"""Helpers for testing a project that uses djlocks.

``use_locmem_backends()`` points every configured backend alias at the
in-process ``LocMemBackend`` for the duration of a block, a test function or
each test of a ``TestCase``: locks work between the test's threads without a
lock store, without writing to the database, and inside the test's
transaction. With pytest, the ``locmem_locks`` fixture does the same (see
``djlocks.pytest_plugin``)::

    from djlocks.testing import use_locmem_backends

    @use_locmem_backends()
    class ReportTests(TestCase):
        def test_nightly(self):
            with db_lock("reports:nightly", timeout=0):
                ...

A ``LocMemBackend`` locks only between the threads of one process: tests
that start other processes to contend for a lock need a real backend.
"""

from __future__ import annotations

import unittest
from typing import Any, TypeVar

from django.conf import settings
from django.test import override_settings

from djlocks.backends import backends
from djlocks.conf import djlocks_settings

#: The dotted path of the in-process backend, as ``DJLOCKS["BACKENDS"]`` spells it.
LOCMEM_BACKEND = "djlocks.backends.locmem.LocMemBackend"

C = TypeVar("C", bound=type)


def locmem_settings() -> dict[str, Any]:
    """The current ``DJLOCKS`` setting with every alias (and ``"default"``) on ``LocMemBackend``.

    Keys other than ``BACKENDS`` (``TTL``, ``EVENTS``, ...) are kept as configured.
    Reads the settings, so call it when they are configured, not at import time.
    """
    configured: dict[str, Any] = dict(getattr(settings, "DJLOCKS", {}) or {})
    aliases = sorted({*djlocks_settings()["BACKENDS"], "default"})
    return {**configured, "BACKENDS": {alias: {"BACKEND": LOCMEM_BACKEND} for alias in aliases}}


class use_locmem_backends(override_settings):  # lower case, like override_settings
    """Run a block, a test function or each test of a test class on ``LocMemBackend``.

    Overrides the ``DJLOCKS`` setting with ``locmem_settings()``, computed when
    the override starts (so a decorator reads no settings at import time).
    Every use starts with empty lock stores and throws them away at its end
    (``backends.reset()`` both times): no grant, waiter, cool-down or fence
    counter carries over from one test to the next. Do not nest two uses:
    the inner one's stores replace the outer one's.

    As a context manager ``with use_locmem_backends():`` (the ``as`` value is
    ``None``); as a decorator on a function, sync or async; as a decorator on a
    ``unittest.TestCase`` subclass (Django's ``TestCase`` and
    ``SimpleTestCase`` included), where it applies to each test separately.
    Decorating any other class raises ``TypeError``. A ``TestCase``'s
    transaction is never touched: ``LocMemBackend`` does not use the database.
    """

    def __init__(self) -> None:
        """Takes no arguments (unlike ``override_settings``): the settings come at ``enable()``."""
        super().__init__()

    def enable(self) -> None:
        """Start the override (with ``DJLOCKS`` as it is now) on empty stores."""
        self.options = {"DJLOCKS": locmem_settings()}
        super().enable()
        backends.reset()

    def disable(self) -> None:
        """Throw the stores away and restore the settings."""
        backends.reset()
        super().disable()

    def decorate_class(self, cls: C) -> C:
        """Apply the override around each test of ``cls``, a ``unittest.TestCase`` subclass.

        ``override_settings`` applies once for a whole Django test class; each test
        here gets stores of its own instead. Raises ``TypeError`` for other classes.
        """
        if not issubclass(cls, unittest.TestCase):
            raise TypeError(
                f"use_locmem_backends() decorates unittest.TestCase subclasses, not "
                f"{cls.__qualname__}; use the locmem_locks fixture in pytest test classes."
            )
        set_up = cls.setUp

        def set_up_on_locmem(test: unittest.TestCase) -> None:
            self.enable()
            test.addCleanup(self.disable)
            set_up(test)

        setattr(cls, "setUp", set_up_on_locmem)  # noqa: B010 - replaces a method
        return cls
