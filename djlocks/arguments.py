"""Validation and normalisation of user arguments, in one place.

Every public entry point funnels names, timeouts, TTLs, cool-downs and limits
through these functions, so each kind of nonsense gets the same clear error.
"""

from __future__ import annotations

import math
from datetime import timedelta

Seconds = int | float | timedelta

MAX_NAME_LENGTH = 255


def validate_name(name: object) -> str:
    """Return ``name`` if it is a usable lock name, else raise ``ValueError``.

    A name is a non-empty ``str`` of at most 255 characters, any Unicode.
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
    return name


def _to_seconds(value: Seconds, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise TypeError(f"{what} must be seconds as int, float or timedelta, not {value!r}.")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if math.isnan(seconds):
        raise ValueError(f"{what} must be a number of seconds, not NaN.")
    if seconds < 0:
        raise ValueError(f"{what} must not be negative (got {seconds} s); use 0 to try once.")
    return seconds


def normalize_timeout(timeout: Seconds | None) -> float | None:
    """Return the wait in seconds: ``None`` waits forever, ``0`` tries once.

    Raises ``ValueError`` for a negative or NaN value, ``TypeError`` for a non-number.
    """
    if timeout is None:
        return None
    seconds = _to_seconds(timeout, "timeout")
    return None if math.isinf(seconds) else seconds


MIN_TTL = 0.3


def normalize_ttl(ttl: Seconds) -> float:
    """Return a lease TTL in seconds; it must be finite and at least 0.3 s.

    The heartbeat renews every third of the TTL, so a shorter lease cannot be
    renewed reliably: a ``ValueError`` says so.
    """
    seconds = _to_seconds(ttl, "ttl")
    if math.isinf(seconds) or seconds < MIN_TTL:
        raise ValueError(
            f"ttl must be a finite number of seconds of at least {MIN_TTL} (got {seconds}); "
            "the heartbeat renews a lease every ttl/3 and needs room to do so."
        )
    return seconds


def normalize_cooldown(cooldown: Seconds) -> float:
    """Return the cool-down in seconds (finite, >= 0)."""
    seconds = _to_seconds(cooldown, "cooldown")
    if math.isinf(seconds):
        raise ValueError("cooldown must be finite; release the name by force to end it early.")
    return seconds


def validate_limit(limit: object) -> int:
    """Return a semaphore ``limit``: an int of at least 1."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {limit!r}.")
    if limit < 1:
        raise ValueError(f"limit must be at least 1 (got {limit}); a lock is a semaphore of 1.")
    return limit
