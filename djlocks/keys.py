"""Names in, keys out: how each store identifies a name.

* lease and row tables: ``key`` = SHA-256 of the UTF-8 name, 64 hex digits.
  Database collations may fold case or accents (MySQL's default does); a hex
  digest compares byte for byte everywhere, so ``"A"`` and ``"a"`` stay apart.
* MySQL/MariaDB ``GET_LOCK``: lock names are at most 64 characters and compared
  without regard to case. A name of at most 50 characters drawn from
  ``a-z 0-9 . _ : / -`` (no capitals, so case cannot matter) becomes
  ``djlocks:<name>``; any other name becomes ``djlocks#`` and the first 40 hex
  digits of its SHA-256. A semaphore's slot ``i`` appends ``/i``, and its
  waiters' gate appends ``/gate``.
* PostgreSQL advisory locks: the one-``bigint`` form, the first 8 bytes of the
  SHA-256 of the ``subject`` (below) read as a signed big-endian integer.
* Redis: every key of a name starts ``<prefix>:{<name>}:`` (the braces are a
  Redis Cluster hash tag: one name, one cluster slot). A name that contains a
  brace would break the tag and uses ``{#<SHA-256>}`` instead. The name's
  meta hash ends ``m``; slot ``i``'s lease ``s:i``, its cool-down ``c:i``; the
  queue ``q`` and each waiter's record ``w:<id>``.

A readable name never ends in ``/<digits>`` or ``/gate`` (such names are
hashed), so a lock called ``"x/0"`` never shares a key with slot 0 of ``"x"``.
The PostgreSQL ``subject`` is ``<length of name>:<name>`` plus the same
suffix, unambiguous for the same reason.

``manage.py djlocks key NAME --backend ALIAS`` prints these keys, so that a
shell script using the ``mysql`` or ``psql`` client excludes djlocks holders.
"""

from __future__ import annotations

import hashlib
import re

_READABLE = re.compile(r"[a-z0-9._:/-]{1,50}")
_SLOT_LIKE_END = re.compile(r"/(?:\d+|gate)$")
GATE = "gate"


def table_key(name: str) -> str:
    """Return the 64-hex-digit SHA-256 key that lease rows are stored under."""
    return hashlib.sha256(name.encode()).hexdigest()


def redis_meta_key(prefix: str, name: str) -> str:
    """The Redis key of a name's meta hash (limit, last fence, the name itself)."""
    tag = f"#{hashlib.sha256(name.encode()).hexdigest()}" if "{" in name or "}" in name else name
    return f"{prefix}:{{{tag}}}:m"


def _suffix(slot: int | str | None) -> str:
    return "" if slot is None else f"/{slot}"


def mysql_key(name: str, slot: int | str | None = None) -> str:
    """The ``GET_LOCK`` name of a lock (``slot=None``), a slot, or a semaphore's gate."""
    if _READABLE.fullmatch(name) and not _SLOT_LIKE_END.search(name):
        return f"djlocks:{name}{_suffix(slot)}"
    return f"djlocks#{hashlib.sha256(name.encode()).hexdigest()[:40]}{_suffix(slot)}"


def advisory_key(name: str, slot: int | str | None = None) -> int:
    """The ``pg_advisory_lock(bigint)`` key of a lock, a slot, or a semaphore's gate."""
    subject = f"{len(name)}:{name}{_suffix(slot)}"
    return int.from_bytes(hashlib.sha256(subject.encode()).digest()[:8], "big", signed=True)
