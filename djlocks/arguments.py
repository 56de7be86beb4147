"""Validation and normalisation of user arguments, in one place.

Every public entry point funnels names, timeouts, TTLs, cool-downs and limits
through these functions, so each kind of nonsense gets the same clear error.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable
from datetime import timedelta

from djlocks.written import RECHECK, SHORTEST_IDLE

Seconds = int | float | timedelta

MAX_NAME_LENGTH = 255
#: The names a program's main module goes by: ``__main__``, and ``__mp_main__`` in the
#: processes that ``multiprocessing`` spawns, which import it under that name.
MAIN_MODULES = ("__main__", "__mp_main__")
#: Characters of a label (``Lock(label=...)``, ``runlocked --label``); the stores keep 255.
MAX_LABEL_LENGTH = 255
#: NUL, which no database stores in text, and lone surrogates, which are not Unicode
#: text at all (Python decodes bytes that were not UTF-8, e.g. from ``sys.argv``, to them).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def validate_name(name: object) -> str:
    """Return ``name`` if it is a usable lock name, else raise ``ValueError``.

    A name is a non-empty ``str`` of at most 255 characters, any Unicode but NUL
    and lone surrogates (see ``validate_text``). Raises ``TypeError`` for a non-str.
    """
    if not isinstance(name, str):
        raise TypeError(f"A lock name must be a str, not {type(name).__name__}.")
    if not name:
        raise ValueError("A lock name must not be empty; pass a name such as 'reports:nightly'.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"A lock name has at most {MAX_NAME_LENGTH} characters; this one has {len(name)}. "
            "Use a shorter name, or hash the long part yourself."
        )
    return validate_text(name, "A lock name")


def function_lock_name(func: Callable[..., object]) -> str:
    """The name ``@db_lock()`` gives the lock of ``func`` when it is given none: the
    function's ``module.qualname`` (``"myapp.jobs.cleanup"``).

    A function of the main module is named after the module it was run as (``python
    -m myapp.jobs`` gives ``"myapp.jobs.cleanup"``, as an import would), also in the
    processes that ``multiprocessing`` spawns, which import it as ``__mp_main__``.
    Raises ``ValueError`` for one whose module has no such name (a script run by its
    path, the shell): ``"__main__.cleanup"`` would be the name of every script's
    ``cleanup``, and not the name of the same function imported elsewhere."""
    module: str | None = func.__module__  # None for a function of Django's shell
    if module in MAIN_MODULES:
        spec = getattr(sys.modules.get(module), "__spec__", None)
        module = None if spec is None or spec.name in MAIN_MODULES else spec.name
    if module is None:
        raise ValueError(
            f"@db_lock() cannot name the lock of {func.__qualname__}(): it is defined in "
            f"a script run by its path or in the shell, whose module has no name of its "
            f"own, so every script's {func.__qualname__}() would share one lock. Name "
            f'it: @db_lock("myproject.{func.__qualname__}"), or run the module with '
            f"python -m."
        )
    return validate_name(f"{module}.{func.__qualname__}")


def validate_label(label: object) -> str | None:
    """Return ``label`` (``None``: the default, the process's command line) if usable.

    A label is a ``str`` of at most ``MAX_LABEL_LENGTH`` (255) characters, empty
    allowed, any Unicode but NUL and lone surrogates (see ``validate_text``).
    Raises ``ValueError`` for a bad one, ``TypeError`` for a non-str.
    """
    if label is None:
        return None
    if not isinstance(label, str):
        raise TypeError(f"A label must be a str or None, not {type(label).__name__}.")
    if len(label) > MAX_LABEL_LENGTH:
        raise ValueError(
            f"A label has at most {MAX_LABEL_LENGTH} characters; this one has {len(label)}. "
            "Shorten it: it is shown to operators, who need its start."
        )
    return validate_text(label, "A label")


def validate_text(text: str, what: str) -> str:
    """Return ``text`` if every store can keep it, else raise ``ValueError``.

    ``what`` names the text in the message (``"A lock name"``). Refused: NUL,
    which no database keeps in text, and lone surrogates (U+D800 to U+DFFF),
    which are not Unicode: Python makes them from bytes that were not UTF-8,
    such as a command-line argument in another encoding.
    """
    found = _UNSTORABLE.search(text)
    if found is None:
        return text
    where = f"at position {found.start()}"
    if found.group() == "\x00":
        raise ValueError(
            f"{what} must not contain NUL (\\x00, {where}): databases cannot store it. Remove it."
        )
    raise ValueError(
        f"{what} must be Unicode text, but holds the lone surrogate "
        f"{_escaped(found)} {where}: bytes that were not "
        f"UTF-8 (a command-line argument in another encoding arrives like this). "
        f"Pass UTF-8 text."
    )


@functools.lru_cache(maxsize=256)  # called per grant on a few thread names and one command line
def storable(text: str, max_length: int) -> str:
    """``text`` made storable and cut to ``max_length`` characters, for text that
    djlocks itself gathers (the command line as a default label, a thread's name).

    NUL and lone surrogates become the escapes ``\\x00`` and ``\\udcff``: the
    text stays readable to operators instead of being refused.
    """
    return _UNSTORABLE.sub(_escaped, text)[:max_length]


#: Characters a terminal acts on (C0 and C1 controls, DEL: ESC starts screen-clearing
#: and title-setting sequences), that reorder a line (bidirectional embeddings,
#: overrides and isolates), or that are not text (lone surrogates).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on shown as an escape.

    For command-line output of names, labels, hosts and threads that anyone may
    have chosen: ``"a\\x1b[2Jb\\n"`` prints as ``a\\x1b[2Jb\\n``, never clearing
    the screen. Newline, tab and carriage return become ``\\n``, ``\\t``, ``\\r``;
    other controls ``\\xNN`` or ``\\uNNNN``. Other text, backslashes included, is unchanged.
    """
    return _UNPRINTABLE.sub(_escaped, text)


def _escaped(found: re.Match[str]) -> str:
    return found.group().encode("unicode_escape", "backslashreplace").decode("ascii")


def _to_seconds(value: Seconds, what: str, negative_hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise TypeError(f"{what} must be seconds as int, float or timedelta, not {value!r}.")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if math.isnan(seconds):
        raise ValueError(f"{what} must be a number of seconds, not NaN.")
    if seconds < 0:
        raise ValueError(f"{what} must not be negative (got {seconds} s){negative_hint}.")
    return seconds


#: The longest TTL and cool-down, in seconds (365 days): every store can keep an
#: expiry this far ahead, and a thread can wait a third of it.
MAX_PERIOD = 365 * 24 * 3600.0


def normalize_timeout(timeout: Seconds | None) -> float | None:
    """Return the wait in seconds: ``None`` waits forever, ``0`` tries once.

    A wait longer than ``MAX_PERIOD`` (365 days), infinity included, is a wait
    forever. Raises ``ValueError`` for a negative or NaN value, ``TypeError`` for
    a non-number.
    """
    if timeout is None:
        return None
    seconds = _to_seconds(timeout, "timeout", "; use 0 to try once")
    return None if seconds > MAX_PERIOD else seconds


MIN_TTL = 0.3


def normalize_ttl(ttl: Seconds) -> float:
    """Return a lease TTL in seconds: at least 0.3 s, at most ``MAX_PERIOD`` (365 days).

    The heartbeat renews every third of the TTL, so a shorter lease cannot be
    renewed reliably; a longer one is what renewal is for. A ``ValueError`` says so.
    """
    seconds = _to_seconds(ttl, "ttl")
    if seconds < MIN_TTL:
        raise ValueError(
            f"ttl must be at least {MIN_TTL} seconds (got {seconds}): "
            "the heartbeat renews a lease every ttl/3 and needs room to do so."
        )
    if seconds > MAX_PERIOD:
        raise ValueError(
            f"ttl must be at most {MAX_PERIOD:.0f} seconds (365 days; got {seconds}): "
            "a holder that works longer keeps a shorter lease renewed."
        )
    return seconds


def normalize_cooldown(cooldown: Seconds) -> float:
    """Return the cool-down in seconds: from 0 to ``MAX_PERIOD`` (365 days).

    Raises ``ValueError`` outside that range, ``TypeError`` for a non-number.
    """
    seconds = _to_seconds(cooldown, "cooldown")
    if seconds > MAX_PERIOD:
        raise ValueError(
            f"cooldown must be at most {MAX_PERIOD:.0f} seconds (365 days; got {seconds}); "
            "release the name by force to end a cool-down early."
        )
    return seconds


def normalize_max_hold(max_hold: Seconds | None) -> float | None:
    """Return the longest a grant may be held, in seconds: more than 0, at most
    ``MAX_PERIOD`` (365 days); ``None`` for no bound.

    Raises ``ValueError`` outside that range, ``TypeError`` for a non-number.
    """
    if max_hold is None:
        return None
    hint = "; leave max_hold out (None) for no bound"
    seconds = _to_seconds(max_hold, "max_hold", hint)
    if seconds == 0:
        raise ValueError(f"max_hold must be more than 0 seconds{hint}.")
    if seconds > MAX_PERIOD:
        raise ValueError(f"max_hold must be at most {MAX_PERIOD:.0f} seconds (365 days){hint}.")
    return seconds


def normalize_idle_names(idle: Seconds | None) -> float | None:
    """Return after how many seconds since its last grant a sweep removes an idle
    name: at least ``written.SHORTEST_IDLE`` (120), at most ``MAX_PERIOD`` (365
    days); ``None``: names are kept.

    Raises ``ValueError`` outside that range, ``TypeError`` for a non-number.
    """
    if idle is None:
        return None
    seconds = _to_seconds(idle, "the idle time of names")
    if seconds > MAX_PERIOD:
        raise ValueError(
            f"the idle time of names must be at most {MAX_PERIOD:.0f} seconds (365 days; "
            f"got {seconds:g}); leave it out (None) to keep every name."
        )
    if seconds < SHORTEST_IDLE:
        raise ValueError(
            f"the idle time of names must be at least {SHORTEST_IDLE:g} seconds (got "
            f"{seconds:g}): a process re-checks every {RECHECK:g} s that the names it "
            f"created are still there."
        )
    return seconds


def normalize_delay(delay: Seconds, what: str) -> float:
    """Return a delay in seconds: more than 0, at most ``MAX_PERIOD`` (365 days).

    ``what`` names the argument in the ``ValueError`` (out of range) or ``TypeError``.
    """
    seconds = _to_seconds(delay, what)
    if not 0 < seconds <= MAX_PERIOD:
        raise ValueError(
            f"{what} must be more than 0 seconds and at most {MAX_PERIOD:.0f} (got {seconds})."
        )
    return seconds


def validate_limit(limit: object, what: str = "limit") -> int:
    """Return a semaphore ``limit``: an int of at least 1. ``what`` names the argument in
    the ``TypeError`` or ``ValueError``."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"{what} must be an int, not {limit!r}.")
    if limit < 1:
        why = "; a lock is a semaphore of 1" if what == "limit" else ""
        raise ValueError(f"{what} must be at least 1 (got {limit}){why}.")
    return limit
