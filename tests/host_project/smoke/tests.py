"""The host project's own tests: what a project that uses djlocks writes.

Run by `manage.py test` in a project made with `django-admin startproject`
into which the installation test installed djlocks from its wheel.
"""

from django.conf import settings
from django.db import connection
from django.test import TestCase, TransactionTestCase

from djlocks import Lock, NotAcquired, db_lock, db_semaphore
from djlocks.testing import use_locmem_backends

#: The djlocks backend aliases the project configured ("default" when it set none).
ALIASES = tuple(sorted(getattr(settings, "DJLOCKS", {}).get("BACKENDS", ["default"])))


@db_lock("smoke:decorated", timeout=0, on_busy="skip")
def nightly_report() -> str:
    return "ran"


class LocksBehave:
    """The same checks on whatever stores the test class points the aliases at."""

    aliases = ALIASES

    def test_a_lock_excludes_a_second_handle_and_fences_rise(self) -> None:
        for alias in self.aliases:
            with self.subTest(backend=alias):
                with db_lock("smoke:lock", timeout=5, backend=alias) as first:
                    self.assertFalse(Lock("smoke:lock", backend=alias).acquire(timeout=0))
                    with (
                        self.assertRaises(NotAcquired),
                        db_lock("smoke:lock", timeout=0, backend=alias),
                    ):
                        pass
                with db_lock("smoke:lock", timeout=5, backend=alias) as second:
                    self.assertGreater(second.fence, first.fence)

    def test_a_semaphore_admits_its_limit(self) -> None:
        for alias in self.aliases:
            with self.subTest(backend=alias):
                pdf_render = db_semaphore("smoke:pdf", limit=2, timeout=5, backend=alias)
                with pdf_render, pdf_render:
                    self.assertFalse(pdf_render.acquire(timeout=0))

    def test_a_busy_decorated_call_is_skipped(self) -> None:
        self.assertEqual(nightly_report(), "ran")
        with db_lock("smoke:decorated", timeout=0):
            self.assertIsNone(nightly_report())


@use_locmem_backends()
class InProcessLocks(LocksBehave, TestCase):
    """The locmem backend: no store, works inside TestCase's transaction everywhere."""


class StoreLocks(LocksBehave, TransactionTestCase):
    """The stores the project configured, as its production code uses them."""


if connection.vendor != "sqlite":

    class LeasesInATestCase(LocksBehave, TestCase):
        """On PostgreSQL and MySQL the lease backend works inside TestCase's transaction
        (its rows are written on a connection of its own). Session locks refuse to be
        taken inside a transaction, which they would not cover: TransactionTestCase."""

        aliases = ("default",)
