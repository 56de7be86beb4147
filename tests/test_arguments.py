"""Bad input gets a clear, specific error and changes nothing."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from djlocks import Lock, Semaphore, db_lock, db_rwlock, db_semaphore
from djlocks.arguments import normalize_timeout
from djlocks.backends.lease.claims import MAX_SLOTS
from djlocks.models import LeaseSlot


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": ""}, ValueError, "must not be empty"),
        ({"name": "x" * 256}, ValueError, "at most 255"),
        ({"name": 7}, TypeError, "must be a str"),
        ({"name": "x", "timeout": -1}, ValueError, "must not be negative"),
        ({"name": "x", "timeout": math.nan}, ValueError, "not NaN"),
        ({"name": "x", "timeout": "5"}, TypeError, "seconds"),
        ({"name": "x", "ttl": 0.1}, ValueError, "at least 0.3"),
        ({"name": "x", "ttl": math.inf}, ValueError, "at most 31536000"),
        ({"name": "x", "cooldown": 1e12}, ValueError, "at most 31536000"),
        ({"name": "x", "ttl": -5}, ValueError, "must not be negative"),
        ({"name": "x", "cooldown": -1}, ValueError, "must not be negative"),
        ({"name": "x", "backend": ""}, ValueError, "alias"),
    ],
)
def test_lock_arguments_are_checked_at_construction(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Lock(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("limit", "error"), [(0, ValueError), (-3, ValueError), (1.5, TypeError)])
def test_semaphore_limit_must_be_a_positive_int(limit: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="limit"):
        Semaphore("x", limit=limit)  # type: ignore[arg-type]


def test_a_readers_limit_is_named_as_such() -> None:
    with pytest.raises(ValueError, match=r"^max_readers must be at least 1 \(got 0\)\.$"):
        db_rwlock("x", max_readers=0)


def test_a_timeout_with_blocking_false_is_refused_before_any_io() -> None:
    # No db fixture: the refusal comes before the store is asked, as threading.Lock's.
    with pytest.raises(ValueError, match="blocking=False"):
        Lock("x").acquire(blocking=False, timeout=5)


def test_blocking_false_with_a_timeout_of_0_tries_once(transactional_db: None) -> None:
    lock = Lock("x")
    assert lock.acquire(blocking=False, timeout=0) is True
    lock.release()


def test_a_lease_semaphore_too_large_is_refused_and_writes_nothing(
    transactional_db: None,
) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_SLOTS} slots \\(got {MAX_SLOTS + 1}\\)"):
        Semaphore("x", limit=MAX_SLOTS + 1, timeout=0).acquire()
    assert not LeaseSlot.objects.exists()
    with Semaphore("x", limit=MAX_SLOTS, timeout=0) as grant:
        assert grant.slot == 0


def test_timeouts_are_normalised_in_one_place() -> None:
    assert normalize_timeout(None) is None
    assert normalize_timeout(0) == 0.0
    assert normalize_timeout(timedelta(milliseconds=1500)) == 1.5
    assert normalize_timeout(math.inf) is None
    assert normalize_timeout(1e300) is None  # longer than a thread can wait: forever


def test_long_unicode_names_are_accepted() -> None:
    assert Lock("ü" * 255).name == "ü" * 255


def test_unnamed_lock_needs_the_decorator_form() -> None:
    with pytest.raises(ValueError, match="no name"), Lock():
        pass


def test_unknown_backend_alias_says_which_exist(transactional_db: None) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"'nope'.*configured: default"):
        db_lock("x", backend="nope", timeout=0).acquire()


def test_a_spec_does_no_io_at_construction() -> None:
    # No db fixture here: pytest-django refuses any database access in this test,
    # so building a spec must not touch the store. The backend alias is not even
    # looked up until the first acquire.
    lock = db_semaphore("pdf-render", limit=5, ttl=60, timeout=30, backend="not-configured")
    with pytest.raises(ImproperlyConfigured, match="not-configured"):
        lock.backend  # noqa: B018 - resolving the alias is the first use


def test_stress_rejects_nonsense_counts(transactional_db: None) -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="at least 1"):
        call_command("djlocks", "stress", "--limit", "0")


DECORATED = """
import django
django.setup()
from djlocks import db_lock
from djlocks.arguments import function_lock_name
def cleanup():
    pass
try:
    db_lock()(cleanup)
except ValueError as exc:
    print("refused:", exc)
else:
    print("named:", function_lock_name(cleanup))
"""


@pytest.mark.parametrize("run_as", ["script", "module"])
def test_a_function_of_main_is_named_after_its_module_or_must_be_named(
    run_as: str, tmp_path: Path
) -> None:
    """``python -m nightly`` names ``@db_lock()``'s lock ``nightly.cleanup``, as an import
    would; a script run by its path (or the shell) has no module name to give, and
    ``__main__.cleanup`` would be every script's ``cleanup``."""
    (tmp_path / "nightly.py").write_text(DECORATED)
    command = ["-m", "nightly"] if run_as == "module" else [str(tmp_path / "nightly.py")]
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent)])
    ran = subprocess.run(
        [sys.executable, *command],
        env={**os.environ, "PYTHONPATH": path, "DJANGO_SETTINGS_MODULE": "project.settings"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    if run_as == "module":
        assert ran.stdout.strip() == "named: nightly.cleanup", ran.stdout
    else:
        assert ran.stdout.startswith("refused: @db_lock() cannot name the lock of cleanup()")
        assert '@db_lock("myproject.cleanup")' in ran.stdout, ran.stdout


SPAWNING = """
import multiprocessing
import django
django.setup()
from djlocks.arguments import function_lock_name
def cleanup():
    pass
def name_in_child():
    return function_lock_name(cleanup)
if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(function_lock_name(cleanup), pool.apply(name_in_child))
"""


def test_a_module_run_with_python_m_names_its_lock_alike_in_the_processes_it_spawns(
    tmp_path: Path,
) -> None:
    """A spawned process imports the main module as ``__mp_main__``: its lock must have
    the parent's name, or the two would not exclude each other."""
    (tmp_path / "nightly.py").write_text(SPAWNING)
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent)])
    ran = subprocess.run(
        [sys.executable, "-m", "nightly"],
        env={**os.environ, "PYTHONPATH": path, "DJANGO_SETTINGS_MODULE": "project.settings"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert ran.stdout.split() == ["nightly.cleanup", "nightly.cleanup"], ran.stdout


def test_a_function_of_djangos_shell_must_name_its_lock() -> None:
    """``manage.py shell`` runs its code without a ``__name__``: its functions' module is
    ``None``."""

    def cleanup() -> None:
        pass

    cleanup.__module__ = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"cannot name the lock of .*cleanup\(\)"):
        db_lock()(cleanup)
