"""The pytest plugin of djlocks (entry point ``djlocks``): the ``locmem_locks`` fixture.

Installed with djlocks, so any test may ask for it::

    def test_report_runs_once(locmem_locks):
        with db_lock("reports:nightly", timeout=0):
            ...

This module imports nothing from Django, so that loading the plugin before
the settings are configured (as pytest does with entry points) is safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from djlocks.backends.locmem import LocMemBackend


@pytest.fixture
def locmem_locks() -> Iterator[LocMemBackend]:
    """Run the test with every ``DJLOCKS["BACKENDS"]`` alias on ``LocMemBackend``.

    Applies ``djlocks.testing.use_locmem_backends()`` for the test: the stores
    are empty at its start and thrown away at its end. Yields the backend of
    the ``"default"`` alias, to inspect (``holders()``, ``waiters()``, ...).
    Needs configured Django settings (pytest-django's ``DJANGO_SETTINGS_MODULE``),
    but no database.
    """
    from djlocks.backends import backends
    from djlocks.backends.locmem import LocMemBackend
    from djlocks.testing import use_locmem_backends

    with use_locmem_backends():
        default = backends["default"]
        assert isinstance(default, LocMemBackend)
        yield default
