"""Names in, keys out: how each store identifies a name, and why two never meet.

Every key function here is injective: distinct names (and distinct slots of
one name) get distinct keys, so two locks never share a store entry. Where a
form is readable, the proof is that the key can be read back; where it is a
hash, the chance of a collision is the hash's, bounded below.

A *slot* is a semaphore's slot number (an ``int`` from 0 to 99,999,999) or a
*gate word* (``"gate"``, ``"row-gate"``: a lower-case letter, then up to 7
lower-case letters or ``-``). Written as text (``_slot_text``), distinct
slots stay distinct: a number is its decimal digits without leading zeros, a
word starts with a letter, and a digit is not a letter. Anything else raises
``ValueError``.

* Lease and row tables, ``table_key(name)``: the SHA-256 of the UTF-8 name, 64
  lower-case hex digits (the slot is a column of its own). UTF-8 is injective,
  so two names share a key only if SHA-256 collides (none is known; finding one
  takes about 2**128 hashes). Database collations may fold case or accents
  (MySQL's default does); hex digits compare byte for byte everywhere.
* MySQL/MariaDB ``GET_LOCK``, ``mysql_key(name, slot)``: lock names are at most
  64 characters and compared without regard to case. The key is ``djlocks``,
  a tag, a body, and ``/<slot>`` for a slot or a gate:

  - tag ``:``, body the name itself, for a *readable* name: 1 to 47 characters
    from ``a-z 0-9 . _ : -`` (no capitals, no ``/``);
  - tag ``#``, body the first 40 hex digits of the name's SHA-256, for every
    other name.

  The tag says which form follows; neither body holds a ``/``, so the first
  ``/`` ends the body and the slot text follows it. So the key reads back as
  (form, body, slot): readable names are their own bodies, a readable key never
  equals a hashed one (``#`` is not readable), and two hashed names share a key
  only if the first 160 bits of their SHA-256 match (about n**2 / 2**161 for n
  hashed names: nil in practice). A lock called ``"x/0"`` is hashed and never
  meets slot 0 of ``"x"``. Length: at most 8 + 47 + 9 (``/row-gate``) = 64.
  Every character is one of ``a-z 0-9 . _ : / - #``, in which no two distinct
  strings compare equal under any collation: case cannot matter.
* PostgreSQL advisory locks, ``advisory_key(name, slot)``: the one-``bigint``
  form, the first 8 bytes of the SHA-256 of ``<length of name>:<name>`` plus
  ``/<slot>``, read as a signed big-endian integer. That subject is injective
  (the length says where the name ends), but the key keeps only 64 bits: among
  n keys in use at once, two coincide with a probability of about n**2 / 2**65
  (the birthday bound: 1 in 37 million for a million keys, 1 in 370 billion
  for ten thousand). Such a coincidence makes two names wait for each other;
  it never lets two holders share one name. Other software that takes
  one-``bigint`` advisory locks in the same database shares this key space.
* Redis, ``redis_key(prefix, name, part)``: ``<prefix>:{<escaped name>}:<part>``.
  The name is escaped by writing ``%`` as ``%25``, ``{`` as ``%7B`` and ``}``
  as ``%7D`` (every other character as itself), so no hash is needed: each
  ``%`` of the escaped name starts one of the three escapes, which read back
  to the name. The prefix holds no brace (the backend checks it), nor does the
  escaped name, so the first ``{`` and the next ``}`` cut the key into prefix,
  name and part. The braces are a Redis Cluster hash tag: one name, one
  cluster slot. The parts (written by the Lua scripts too): ``m`` the name's
  meta hash, ``q`` its queue, ``s:<i>`` slot i's lease, ``c:<i>`` its
  cool-down, ``w:<id>`` a waiter's record, ``h:<id>`` its line (``lines``).

``manage.py djlocks key NAME --backend ALIAS`` prints the session backends'
keys, so that a shell script using the ``mysql`` or ``psql`` client excludes
djlocks holders.
"""

from __future__ import annotations

import functools
import hashlib
import re

GATE = "gate"
#: Keys kept for names used again (each lock and release of a name needs its key).
KEYS_CACHED = 4096
#: GET_LOCK's limit on a lock name, in characters.
MYSQL_KEY_LENGTH = 64
_MYSQL_READABLE = "djlocks:"
_MYSQL_HASHED = "djlocks#"
_MYSQL_HASH_DIGITS = 40
#: The longest slot text: 8 digits, or a gate word of 8 characters.
_SLOT_TEXT_LENGTH = 8
_SLOT_NUMBERS = 10**_SLOT_TEXT_LENGTH
_GATE_WORD = re.compile(rf"[a-z][a-z-]{{0,{_SLOT_TEXT_LENGTH - 1}}}")
#: A readable name leaves room for the tag and the longest ``/<slot>``.
_READABLE_LENGTH = MYSQL_KEY_LENGTH - len(_MYSQL_READABLE) - 1 - _SLOT_TEXT_LENGTH
_READABLE = re.compile(rf"[a-z0-9._:-]{{1,{_READABLE_LENGTH}}}")
_REDIS_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def _sha256(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _slot_text(slot: int | str) -> str:
    """``slot`` as text: a number's decimal digits, or a gate word as it is.

    Raises ``ValueError`` for a number outside 0..99,999,999, a ``bool``, or a
    string that is not a gate word.
    """
    if isinstance(slot, int) and not isinstance(slot, bool) and 0 <= slot < _SLOT_NUMBERS:
        return str(slot)
    if isinstance(slot, str) and _GATE_WORD.fullmatch(slot):
        return slot
    raise ValueError(
        f"A slot is a number from 0 to {_SLOT_NUMBERS - 1} or a gate word such as "
        f"{GATE!r}, not {slot!r}."
    )


def _suffix(slot: int | str | None) -> str:
    """``""`` for the name itself, ``/<slot text>`` for a slot or a gate."""
    return "" if slot is None else "/" + _slot_text(slot)


@functools.lru_cache(maxsize=KEYS_CACHED)
def table_key(name: str) -> str:
    """The 64-hex-digit SHA-256 (``str``) that rows of ``name`` are stored under."""
    return _sha256(name)


@functools.lru_cache(maxsize=KEYS_CACHED, typed=True)  # a bool slot is not slot 0 or 1
def mysql_key(name: str, slot: int | str | None = None) -> str:
    """The ``GET_LOCK`` name (``str``, at most 64 characters, no capitals) of a lock
    (``slot=None``), a slot, or a gate; ``ValueError`` for a bad slot."""
    if _READABLE.fullmatch(name):
        body = _MYSQL_READABLE + name
    else:
        body = _MYSQL_HASHED + _sha256(name)[:_MYSQL_HASH_DIGITS]
    return body + _suffix(slot)


@functools.lru_cache(maxsize=KEYS_CACHED, typed=True)  # a bool slot is not slot 0 or 1
def advisory_key(name: str, slot: int | str | None = None) -> int:
    """The ``pg_advisory_lock(bigint)`` key (a signed 64-bit ``int``) of a lock
    (``slot=None``), a slot, or a gate; ``ValueError`` for a bad slot."""
    subject = f"{len(name)}:{name}{_suffix(slot)}"
    return int.from_bytes(hashlib.sha256(subject.encode()).digest()[:8], "big", signed=True)


def redis_key(prefix: str, name: str, part: str) -> str:
    """The Redis key (``str``) of ``part`` (``"m"``, ``"q"``, ``"s:0"`` ...) of ``name``
    under ``prefix`` (letters, digits and ``_.-:``, as the backend checks)."""
    return f"{prefix}:{{{name.translate(_REDIS_ESCAPES)}}}:{part}"


def redis_meta_key(prefix: str, name: str) -> str:
    """The Redis key (``str``) of a name's meta hash (limit, last fence, the name itself)."""
    return redis_key(prefix, name, "m")
