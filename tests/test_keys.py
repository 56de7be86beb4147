"""Every key function gives distinct (name, slot) distinct keys: property tests over
any name of up to 255 characters, every slot and every Redis prefix; the readable
forms are read back to what they encode, which is the proof. The collisions of the
earlier scheme are regression tests."""

from __future__ import annotations

import hashlib
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from djlocks.arguments import MAX_NAME_LENGTH
from djlocks.backends.redis import PREFIX_CHARACTERS
from djlocks.backends.row.dialect import ROW_GATE
from djlocks.keys import (
    GATE,
    MYSQL_KEY_LENGTH,
    advisory_key,
    mysql_key,
    redis_key,
    redis_meta_key,
    table_key,
)

Slot = int | str | None

#: The last slot number a key can carry (8 digits).
LAST_SLOT = 10**8 - 1


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})
NAMES = st.one_of(
    # Any Unicode: lone surrogates are refused by validate_name before any key is made.
    st.text(min_size=1, max_size=MAX_NAME_LENGTH),
    # Near the edges of the forms: separators, tags, escapes, slot-like endings.
    st.text(alphabet="ax0-._:/#%{}7BDgte", min_size=1, max_size=70),
    # Look-alikes of a hashed form and of an escaped name.
    st.text(max_size=20).map(lambda name: "#" + sha256(name)),
    st.text(alphabet="ab{}%", max_size=8).map(lambda name: name.translate(ESCAPES) or "%"),
)
SLOTS = st.one_of(
    st.none(), st.integers(0, LAST_SLOT), st.sampled_from([GATE, ROW_GATE, "a", "z-z-z-zz"])
)
PREFIXES = st.text(alphabet=sorted(PREFIX_CHARACTERS), min_size=1, max_size=20)
PARTS = st.one_of(
    st.sampled_from(["m", "q"]),
    st.integers(0, 9999).map("s:{}".format),
    st.integers(0, 9999).map("c:{}".format),
    st.binary(min_size=16, max_size=16).map(lambda secret: "w:" + secret.hex()),
)
#: Characters no collation folds into one another: lower-case ASCII and punctuation.
CASE_PROOF = set("abcdefghijklmnopqrstuvwxyz0123456789._:/-#")


def slot_text(slot: Slot) -> str | None:
    return None if slot is None else str(slot)


# -- MySQL / MariaDB GET_LOCK ---------------------------------------------------------


def read_mysql_key(key: str) -> tuple[str, str, str | None]:
    """(tag, body, slot text) of a GET_LOCK key, read as djlocks.keys describes it."""
    assert key.startswith("djlocks")
    body, separator, slot = key[8:].partition("/")
    return key[7], body, slot if separator else None


@given(NAMES, SLOTS)
@example("x/0", None)
@example("x/row-gate", None)
@example("A", None)
@example("a" * 50, ROW_GATE)
def test_a_mysql_key_reads_back_to_its_name_or_its_hash_and_its_slot(name: str, slot: Slot) -> None:
    key = mysql_key(name, slot)
    tag, body, text = read_mysql_key(key)
    assert text == slot_text(slot)
    assert (tag, body) in ((":", name), ("#", sha256(name)[:40]))
    assert len(key) <= MYSQL_KEY_LENGTH
    assert set(key) <= CASE_PROOF, "a capital (or any foldable character) in a GET_LOCK name"


@given(st.lists(st.tuples(NAMES, SLOTS), unique=True, max_size=30))
def test_distinct_names_and_slots_get_distinct_mysql_keys(pairs: list[tuple[str, Slot]]) -> None:
    keys = {mysql_key(name, slot).lower() for name, slot in pairs}  # compared without case
    assert len(keys) == len(pairs)


def test_mysql_regressions() -> None:
    assert mysql_key("x/0") != mysql_key("x", 0)
    assert mysql_key("x/gate") != mysql_key("x", GATE)
    assert mysql_key("x/row-gate") != mysql_key("x", ROW_GATE)
    assert len(mysql_key("a" * 50, ROW_GATE)) <= MYSQL_KEY_LENGTH
    assert mysql_key("A").lower() != mysql_key("a").lower()
    assert mysql_key("reports:nightly", 3) == "djlocks:reports:nightly/3"


# -- PostgreSQL advisory locks ------------------------------------------------------


@given(st.lists(st.tuples(NAMES, SLOTS), unique=True, max_size=30))
def test_distinct_names_and_slots_get_distinct_advisory_keys(
    pairs: list[tuple[str, Slot]],
) -> None:
    keys = {advisory_key(name, slot) for name, slot in pairs}
    assert len(keys) == len(pairs)
    assert all(-(2**63) <= key < 2**63 for key in keys)


def test_advisory_regressions() -> None:
    assert advisory_key("x/0") != advisory_key("x", 0)
    assert advisory_key("x/gate") != advisory_key("x", GATE)
    assert advisory_key("1:x") != advisory_key("x")
    # Keys already in use keep their value: the subject did not change.
    subject = b"5:s:job/row-gate"
    assert advisory_key("s:job", ROW_GATE) == int.from_bytes(
        hashlib.sha256(subject).digest()[:8], "big", signed=True
    )


# -- lease and row tables -----------------------------------------------------------


@given(st.lists(NAMES, unique=True, max_size=30))
def test_distinct_names_get_distinct_table_keys(names: list[str]) -> None:
    keys = {table_key(name) for name in names}
    assert len(keys) == len(names)
    assert all(re.fullmatch("[0-9a-f]{64}", key) for key in keys)


def test_table_keys_keep_case_apart() -> None:
    assert table_key("A") != table_key("a") and table_key("é") != table_key("e")


# -- Redis --------------------------------------------------------------------------


def read_redis_key(key: str) -> tuple[str, str, str]:
    """(prefix, name, part) of a Redis key, read as djlocks.keys describes it."""
    prefix, _, rest = key.partition(":{")
    escaped, _, part = rest.partition("}:")
    assert "{" not in escaped and "}" not in escaped
    assert re.fullmatch(r"(?:[^%]|%25|%7B|%7D)+", escaped), "a % that starts no escape"
    unescaped = {"%25": "%", "%7B": "{", "%7D": "}"}
    return prefix, re.sub("%25|%7B|%7D", lambda m: unescaped[m.group()], escaped), part


def cluster_hash_tag(key: str) -> str:
    """What Redis Cluster hashes to place ``key``: between the first ``{`` and the next ``}``."""
    start = key.index("{")
    return key[start + 1 : key.index("}", start + 1)]


@given(PREFIXES, NAMES, PARTS)
@example("djlocks", "{tenant-a}", "m")
@example("djlocks", "#" + sha256("{tenant-a}"), "m")
def test_a_redis_key_reads_back_to_its_prefix_name_and_part(
    prefix: str, name: str, part: str
) -> None:
    key = redis_key(prefix, name, part)
    assert read_redis_key(key) == (prefix, name, part)
    assert cluster_hash_tag(key) == name.translate(ESCAPES), "one name, one cluster slot"
    assert redis_meta_key(prefix, name) == redis_key(prefix, name, "m")


@given(st.lists(st.tuples(PREFIXES, NAMES, PARTS), unique=True, max_size=30))
def test_distinct_prefixes_names_and_parts_get_distinct_redis_keys(
    triples: list[tuple[str, str, str]],
) -> None:
    assert len({redis_key(*triple) for triple in triples}) == len(triples)


def test_a_braced_name_and_the_hash_that_stood_for_it_have_different_redis_keys() -> None:
    """The earlier scheme wrote a braced name as ``#`` and its SHA-256, which is
    also a name anyone may choose: two locks in one Redis lease."""
    braced = "{tenant-a}"
    assert redis_meta_key("djlocks", braced) != redis_meta_key("djlocks", "#" + sha256(braced))
    assert redis_meta_key("djlocks", "%7B") != redis_meta_key("djlocks", "{")


# -- slots --------------------------------------------------------------------------


@pytest.mark.parametrize("slot", [-1, LAST_SLOT + 1, True, "0", "Gate", "", "gate/0", "9lives"])
def test_a_slot_that_cannot_be_written_unambiguously_is_refused(slot: object) -> None:
    for key in (mysql_key, advisory_key):
        key("x", 0), key("x", 1)  # cached keys of the slots a bool equals never answer it
        with pytest.raises(ValueError, match="slot"):
            key("x", slot)  # type: ignore[arg-type]
