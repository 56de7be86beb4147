"""Hostile and unlucky text: names, labels and arguments holding ``%``, quotes, comment
ends, braces, control characters, terminal escapes, NUL, bytes that were not UTF-8,
nothing at all or far too much. Each either works through every backend and command,
shown escaped on a terminal, or is refused before anything is acquired with a clear
message (exit 2 on the command line)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from io import StringIO

import pytest
from django.conf import settings as django_settings
from django.core.management import CommandError, call_command
from django.db import connection, connections
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from djlocks import Lock, Semaphore
from djlocks.arguments import MAX_LABEL_LENGTH, MAX_NAME_LENGTH
from djlocks.backends import backends
from djlocks.backends.base import WaiterInfo
from djlocks.management.commands.runlocked import Command as RunLockedCommand
from djlocks.runlocked import EXIT_CONFLICT, EXIT_UNAVAILABLE
from tests.faults import free_port
from tests.processes import finished, manage, runlocked

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(300)]
SQLITE = connection.vendor == "sqlite"

#: Labels as real command lines and people write them; none may break a query.
HOSTILE_LABELS = [
    "date +%Y-%m-%d",
    "celery -n worker%h",
    "50%s",
    "%(name)s %% % %d",
    "it's \"quoted\" `twice` \\' \\",
    "ends the comment */ SELECT 1; /* and */",
    "{braces} {0} {} {{",
    "tab\there\nnewline\x07bell \x1b[2J\x1b]0;pwned\x07 \u202eright-to-left",
    "GET_LOCK('x', 1) name_key = '" + "0" * 64 + "' SKIP LOCKED",
]
#: Clears the screen and sets the terminal's title, if printed raw.
ESCAPES = "\x1b[2J\x1b]0;pwned\x07"


def aliases_and_limits() -> list[tuple[str, int]]:
    """Every configured backend with a lock and, where it has them, a semaphore."""
    cases = []
    for alias in django_settings.DJLOCKS["BACKENDS"]:
        cases.append((alias, 1))
        if not (SQLITE and alias == "row"):  # SQLite's row lock is its one write lock
            cases.append((alias, 2))
    return cases


def spec(alias: str, name: str, label: str, limit: int) -> Lock:
    if limit == 1:
        return Lock(name, backend=alias, label=label, ttl=30, timeout=60)
    return Semaphore(name, limit=limit, backend=alias, label=label, ttl=30, timeout=60)


def label_in_the_queue(alias: str, label: str) -> str | None:
    """The label as ``waiters()`` shows it, or ``None`` where the server alters it.

    A MariaDB/MySQL waiter is read back from its query's comment, in which ``*/``
    is written ``* /``; PostgreSQL keeps 63 bytes of ``application_name`` in ASCII.
    """
    if alias in ("default", "redis"):
        return label
    if connection.vendor == "mysql":
        return label.replace("*/", "* /")
    return None


def shows_who(alias: str) -> bool:
    """Whether the backend shows holders and waiters (SQLite's write lock shows none)."""
    return not (SQLITE and alias == "row")


def queued(alias: str, name: str, waiting: list[threading.Thread]) -> list[WaiterInfo]:
    """The waiters of ``name`` once one shows (or every waiting thread has ended)."""
    deadline = time.monotonic() + 30
    while not (found := backends[alias].waiters(name)) and any(t.is_alive() for t in waiting):
        assert time.monotonic() < deadline, "the waiter never showed"
        time.sleep(0.05)
    return found


def wait_behind_holders(alias: str, name: str, label: str, limit: int) -> None:
    """Hold every slot of ``name`` with ``label``; as many threads, labelled the same,
    wait in line, show in the queue and are granted once the holders release.

    A row semaphore's first waiter on MariaDB/MySQL polls its slots behind the gate,
    unseen; the second waits in ``GET_LOCK`` on the gate, in the process list."""
    outcome: list[object] = []

    def wait_in_line() -> None:
        try:
            with spec(alias, name, label, limit) as grant:
                outcome.append(grant.fence)
        except Exception as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    waiting = [threading.Thread(target=wait_in_line) for _ in range(limit)]
    with contextlib.ExitStack() as holding:
        for _ in range(limit):
            assert holding.enter_context(spec(alias, name, label, limit)).identity.label == label
        for thread in waiting:
            thread.start()
        if shows_who(alias):
            assert [h.label for h in backends[alias].holders(name)] == [label] * limit
            shown = queued(alias, name, waiting)
            expected = label_in_the_queue(alias, label)
            assert shown, "no waiter showed"
            if expected is not None:
                assert {(w.label, w.pid) for w in shown} == {(expected, os.getpid())}
    for thread in waiting:
        thread.join(60)
    assert len(outcome) == limit and all(isinstance(fence, int) for fence in outcome), outcome


@pytest.mark.parametrize(("alias", "limit"), aliases_and_limits())
def test_hostile_labels_wait_in_line_and_are_granted_on_every_backend(
    alias: str, limit: int
) -> None:
    """On MariaDB/MySQL a waiting row lock and a GET_LOCK wait put the label in an SQL
    comment of a query run with parameters: ``%`` must reach the server as ``%``."""
    for number, label in enumerate(HOSTILE_LABELS):
        wait_behind_holders(alias, f"text:{alias}:{limit}:{number}", label, limit)


# -- what an operator's terminal is sent ------------------------------------------


def djlocks(*args: str) -> str:
    out = StringIO()
    call_command("djlocks", *args, stdout=out)
    return out.getvalue()


def assert_escaped(output: str) -> None:
    assert "\x1b" not in output and "\x07" not in output, repr(output)
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in output, repr(output)


def test_list_and_show_print_control_characters_escaped() -> None:
    name = f"esc{ESCAPES}"
    with Lock(name, ttl=30, label=f"label{ESCAPES}\nsecond line"):
        with Lock(f"cool{ESCAPES}", cooldown=30):
            pass
        for output in (djlocks("list"), djlocks("show", name)):
            assert_escaped(output)
            assert "label\\x1b[2J\\x1b]0;pwned\\x07\\nsecond line" in output
            assert len(output.splitlines()) == (2 if "cool" in output else 1), output
        document = djlocks("list", "--json")
        assert "\x1b" not in document and "\x07" not in document
        (holder,) = json.loads(document)["holders"]
        assert (holder["name"], holder["label"]) == (name, f"label{ESCAPES}\nsecond line")


def read_until(master: int, marker: bytes, process: subprocess.Popen[str]) -> bytes:
    """Read a terminal's output until ``marker`` shows or the process ends."""
    seen = b""
    deadline = time.monotonic() + 60
    while marker not in seen and time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                seen += os.read(master, 4096)
            except OSError:  # the process closed the terminal
                break
        elif process.poll() is not None:
            break
    return seen


def test_the_release_confirmation_prints_control_characters_escaped() -> None:
    """On a real terminal, as an operator runs it, answering no."""
    name = f"release{ESCAPES}"
    with Lock(name, ttl=30, label=f"label{ESCAPES}"):
        master, terminal = os.openpty()
        try:
            asking = manage(
                "djlocks",
                "release",
                name,
                "--no-color",
                stdin=terminal,
                stdout=terminal,
                stderr=terminal,
            )
            os.close(terminal)
            prompt = read_until(master, b"[y/N]", asking)
            os.write(master, b"n\n")
            rest = read_until(master, b"Nothing released", asking)
            assert finished(asking) == 1
        finally:
            os.close(master)
        shown = (prompt + rest).decode()
        assert "[y/N]" in shown and "Nothing released" in shown
        assert_escaped(shown)
        assert len(backends["default"].holders(name)) == 1


def test_release_with_yes_prints_control_characters_escaped() -> None:
    name = f"forced{ESCAPES}"
    Lock(name, ttl=30, label=f"label{ESCAPES}", renew=False).acquire()
    output = djlocks("release", name, "--yes")
    assert_escaped(output)
    assert backends["default"].holders(name) == []


def test_runlocked_says_who_holds_the_name_with_control_characters_escaped() -> None:
    with Lock("text:job", ttl=30, label=f"label{ESCAPES}"):
        waiting = runlocked(
            "text:job", "--timeout", "0.3", "-v", "2", "--", "true", stderr=subprocess.PIPE
        )
        _, said = waiting.communicate(timeout=60)
    assert waiting.returncode == EXIT_CONFLICT
    assert "held by" in said
    assert_escaped(said)


# -- refused before anything is acquired --------------------------------------------


@pytest.mark.parametrize(
    ("name", "label", "message"),
    [
        ("a\x00b", None, r"lock name must not contain NUL \(\\x00, at position 1\)"),
        ("\udcff", None, r"lock name must be Unicode text.*\\udcff at position 0"),
        ("x" * (MAX_NAME_LENGTH + 1), None, "at most 255"),
        ("x", "a\x00", r"label must not contain NUL"),
        ("x", "ok \udc80", r"label must be Unicode text.*\\udc80 at position 3"),
        ("x", "x" * (MAX_LABEL_LENGTH + 1), "label has at most 255 characters; this one has 256"),
    ],
)
def test_bad_text_is_refused_at_construction(name: str, label: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Lock(name, label=label)
    with pytest.raises(ValueError, match=message):
        Semaphore(name, limit=2, label=label)


def test_a_label_must_be_text() -> None:
    with pytest.raises(TypeError, match="label must be a str or None, not int"):
        Lock("x", label=7)  # type: ignore[arg-type]


def test_the_default_label_and_a_thread_name_are_made_storable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What djlocks gathers itself (the command line, a thread's name) is never refused."""
    monkeypatch.setattr(sys, "argv", ["manage.py", "\udcff", "a\x00b", "y" * 300])
    outcome: list[tuple[str, str]] = []

    def hold() -> None:
        try:
            with Lock("text:gathered", ttl=30) as grant:
                outcome.append((grant.identity.thread, grant.identity.label))
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold, name="worker\x00\udcff")
    holder.start()
    holder.join(60)
    ((thread, label),) = outcome
    assert thread.startswith("worker\\x00\\udcff (tid ")
    assert label == ("manage.py \\udcff a\\x00b " + "y" * 300)[:MAX_LABEL_LENGTH]


@pytest.mark.parametrize(
    "arguments",
    [
        ["\udcff", "--", "true"],  # the name was not UTF-8: $'\xff'
        ["job", "--label", "\udcff", "--", "true"],
        ["x" * 10_000, "--", "true"],
    ],
)
def test_runlocked_refuses_bad_text_with_exit_2_and_no_traceback(arguments: list[str]) -> None:
    refused = runlocked(*arguments, stderr=subprocess.PIPE)
    _, said = refused.communicate(timeout=60)
    assert refused.returncode == 2, said
    assert "Traceback" not in said and ("Unicode text" in said or "at most 255" in said), said


def test_runlocked_runs_a_command_whose_arguments_were_not_utf8() -> None:
    """Arguments go to the command as the bytes they were; the label shows them escaped."""
    assert (
        finished(
            runlocked("job", "--", "sh", "-c", 'test "$1" = "$(printf "\\377")"', "-", "\udcff")
        )
        == 0
    )


def test_runlocked_refuses_a_nul_in_the_command_before_acquiring(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as refused:
        RunLockedCommand().run_from_argv(["manage.py", "runlocked", "job", "--", "echo", "a\x00b"])
    assert refused.value.code == 2
    assert "contains NUL" in capsys.readouterr().err
    assert backends["default"].holders("job") == []


@pytest.mark.parametrize(
    "arguments",
    [
        ["show", ""],
        ["show", "x" * 10_000],
        ["show", "a\x00b"],
        ["release", "", "--yes"],
        ["release", "x", "--yes", "--reason", "a\x00b"],
        ["key", "a\x00b"],
    ],
)
def test_the_djlocks_command_refuses_bad_names_with_exit_2(arguments: list[str]) -> None:
    with pytest.raises(CommandError) as refused:
        djlocks(*arguments)
    assert refused.value.returncode == 2


def test_the_djlocks_command_refuses_a_name_that_was_not_utf8_with_exit_2() -> None:
    refused = manage("djlocks", "show", "\udcff", stderr=subprocess.PIPE)
    _, said = refused.communicate(timeout=60)
    assert refused.returncode == 2
    assert "Traceback" not in said and "Unicode text" in said, said


def test_list_exits_69_when_a_store_cannot_be_asked_and_still_shows_the_others() -> None:
    down_cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
    }
    down = {"BACKEND": "djlocks.backends.redis.RedisBackend", "OPTIONS": {"cache": "down"}}
    configured = django_settings.DJLOCKS
    with (
        override_settings(
            CACHES={**django_settings.CACHES, "down": down_cache},
            DJLOCKS={**configured, "BACKENDS": {**configured["BACKENDS"], "down": down}},
        ),
        Lock("text:visible", ttl=30),
    ):
        for arguments in (["list"], ["list", "--json"], ["show", "text:visible"]):
            out, err = StringIO(), StringIO()
            with pytest.raises(CommandError) as failed:
                call_command("djlocks", *arguments, stdout=out, stderr=err)
            assert failed.value.returncode == EXIT_UNAVAILABLE == 69
            assert (
                "text:visible" in out.getvalue() and "'down' could not be asked" in err.getvalue()
            )


# -- any text at all ----------------------------------------------------------------

#: Every code point, surrogates, controls and unassigned ones included.
ANY_CHARACTER = st.characters(exclude_categories=())
#: Pieces that broke, or could break, a query, a comment, a terminal or a driver.
UNLUCKY = st.sampled_from(
    [
        *("%", "%s", "%(x)s", "'", '"', "*/", "/*", "{0}", "\\", "\x00", "\udcff", "\ud800"),
        *("\x1b[2J", "\x1b]0;t\x07", "\n", "\u202e", "ü", "\U0001f512", " "),
    ]
)
TEXT = st.one_of(
    st.lists(st.one_of(ANY_CHARACTER, UNLUCKY), max_size=12).map("".join),
    st.text(ANY_CHARACTER, min_size=250, max_size=300),
)


def storable_as_documented(text: str, max_length: int) -> bool:
    """The documented rule, written out: at most ``max_length`` characters, no NUL,
    no lone surrogate."""
    return len(text) <= max_length and not any(
        character == "\x00" or 0xD800 <= ord(character) <= 0xDFFF for character in text
    )


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(name=TEXT, label=st.none() | TEXT)
def test_any_text_is_locked_and_released_or_refused_as_documented(
    name: str, label: str | None
) -> None:
    """Through a real acquire and release on the lease backend: never another error,
    never a grant or waiter left behind."""
    usable = (
        name != ""
        and storable_as_documented(name, MAX_NAME_LENGTH)
        and (label is None or storable_as_documented(label, MAX_LABEL_LENGTH))
    )
    try:
        lock = Lock(name, label=label, ttl=30, timeout=0)
    except ValueError:
        assert not usable, "refused, but the documented rules allow it"
        return
    assert usable, "accepted, but the documented rules refuse it"
    store = backends["default"]
    with lock as grant:
        (holder,) = store.holders(name)
        assert (holder.name, holder.fence) == (name, grant.fence)
        assert holder.label == (label if label is not None else grant.identity.label)
    assert store.holders(name) == [] and store.waiters(name) == []
