"""What the Lua scripts take and give back: tokens, moments, identities, status codes.

Each operation is one script (``lua/``: ``prelude.lua`` and the operation's
own file), registered once per client and called by SHA (redis-py's
``Script``). Moments cross as milliseconds of Redis's clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from importlib import resources

from djlocks.backends.base import GrantRecord
from djlocks.identity import Identity

SCRIPTS = (
    "acquire",
    "release",
    "renew",
    "leave",
    "force_release",
    "request_release",
    "describe",
    "set_cooldown",
    "sweep",
)
PREFIX_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-:")
SCAN_BATCH = 1000
GRANTED, WAITING, LIMIT_MISMATCH = 1, 0, -1
ENDED, RESTARTED, RELEASE_REQUESTED = 0, -2, 3


@cache
def script_source(name: str) -> str:
    lua = resources.files("djlocks.backends.redis") / "lua"
    return (lua / "prelude.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds (at least 1: ``PX 0`` is an error in Redis)."""
    return max(1, round(seconds * 1000))


def moment(milliseconds: int | bytes | str) -> datetime:
    """A moment of Redis's clock, given in milliseconds, as an aware datetime."""
    return datetime.fromtimestamp(int(milliseconds) / 1000, UTC)


def text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def identity_json(identity: Identity) -> str:
    """The holder's or waiter's identity as stored in Redis (JSON has no raw newline)."""
    return json.dumps([identity.host, identity.pid, identity.thread, identity.label])


def token_of(secret: str, slot: int) -> str:
    """A grant's token: its random secret and its slot, so release finds the slot at once."""
    return f"{secret}.{slot}"


def handed_grant(secret: str, message: str, not_before: float) -> GrantRecord:
    """The grant a release handed this waiter: ``granted\n<slot>\n<fence>\n<expires ms>``,
    made after ``not_before`` (monotonic)."""
    _, slot, fence, expires_ms = message.split("\n")
    return GrantRecord(
        token_of(secret, int(slot)),
        int(slot),
        int(fence),
        moment(expires_ms),
        requested_at=not_before,
    )


def split_token(token: str) -> tuple[str, int]:
    secret, _, slot = token.rpartition(".")
    return secret, int(slot)


@dataclass(frozen=True)
class Attempt:
    """What one acquire script said: a grant, or how long until a slot may free."""

    grant: GrantRecord | None
    sent: float  # time.monotonic() when the script was sent
    soonest: float | None = None  # seconds until the soonest lease or cool-down ends
