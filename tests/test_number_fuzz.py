"""Any limit, timeout, TTL, cool-down or kill-after, through the API and through
``runlocked``: it works, or it is refused before anything is acquired (``ValueError``
or ``TypeError`` from the API, exit 2 with a message from the command), and no grant
or waiter is left behind either way. The rules are written out here as the docs state
them, independently of ``djlocks.arguments``."""

from __future__ import annotations

import itertools
import math
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from djlocks import Semaphore
from djlocks.backends import backends
from djlocks.management.commands.runlocked import Command as RunLockedCommand

pytestmark = pytest.mark.usefixtures("store")

FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NUMBERS = st.one_of(
    st.integers(-3, 4),
    st.floats(-2, 5),
    st.sampled_from([0, 0.0, 0.29, 0.3, math.inf, -math.inf, math.nan, -0.0, 1e12, 1e300]),
    st.builds(timedelta, seconds=st.floats(-2, 5)),
    st.sampled_from([True, False, "5", None, b"1", [1]]),
)


def mostly(
    usable: st.SearchStrategy[object], anything: st.SearchStrategy[object]
) -> st.SearchStrategy[object]:
    """``usable`` two times in three, else ``anything``: so that many examples get a grant."""
    return st.integers(0, 2).flatmap(lambda pick: anything if pick == 0 else usable)


LIMITS = mostly(st.integers(1, 4), NUMBERS)
TIMEOUTS = mostly(st.none() | st.floats(0, 1) | st.just(math.inf), NUMBERS)
TTLS = mostly(st.none() | st.floats(0.3, 120), NUMBERS)
COOLDOWNS = mostly(st.floats(0, 0.1) | st.just(0), NUMBERS)
names = (f"fuzz:{n}" for n in itertools.count())


def seconds(value: object) -> float | None:
    """``value`` as seconds if it is a number of seconds (int, float, timedelta, not a
    bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


YEAR = 365 * 24 * 3600


def usable(limit: object, timeout: object, ttl: object, cooldown: object) -> bool:
    """The documented rules: a limit is an int of at least 1; a timeout is ``None`` or
    seconds, not negative, not NaN (infinite waits forever); a TTL is ``None`` (the
    setting) or seconds from 0.3 to 365 days; a cool-down is seconds from 0 to 365 days."""
    waits, lasts, rests = seconds(timeout), seconds(ttl), seconds(cooldown)
    return (
        isinstance(limit, int)
        and not isinstance(limit, bool)
        and limit >= 1
        and (timeout is None or (waits is not None and waits >= 0))  # NaN >= 0 is False
        and (ttl is None or (lasts is not None and 0.3 <= lasts <= YEAR))
        and rests is not None
        and 0 <= rests <= YEAR
    )


@FUZZ
@given(limit=LIMITS, timeout=TIMEOUTS, ttl=TTLS, cooldown=COOLDOWNS)
def test_any_numbers_work_or_are_refused_through_the_api(
    limit: object, timeout: object, ttl: object, cooldown: object
) -> None:
    name = next(names)
    try:
        semaphore = Semaphore(name, limit=limit, timeout=timeout, ttl=ttl, cooldown=cooldown)  # type: ignore[arg-type]
    except (ValueError, TypeError) as refused:
        event("refused")
        assert not usable(limit, timeout, ttl, cooldown), (
            f"refused, but documented as usable: {refused}"
        )
        assert str(refused), "a refusal says what was wrong"
    else:
        event("granted")
        assert usable(limit, timeout, ttl, cooldown), "accepted, but documented as refused"
        with semaphore as grant:
            assert [h.fence for h in backends["default"].holders(name)] == [grant.fence]
    assert backends["default"].holders(name) == []
    assert backends["default"].waiters(name) == []


#: What people type: numbers, words, nothing, and the spellings Python's float() takes.
TYPED = st.one_of(
    st.sampled_from(["0", "1", "3", "-1", "0.3", "0.29", "2.5", "1e3", "1e309", "-0"]),
    st.sampled_from(["nan", "inf", "-inf", "Infinity", "abc", "", " 2 ", "0x10", "1_0"]),
    st.floats(allow_nan=True).map(repr),
)


def typed_seconds(text: str) -> float | None:
    """What argparse's ``type=float`` makes of ``text``, or ``None`` if it refuses it."""
    try:
        return float(text)
    except ValueError:
        return None


def typed_usable(limit: str, timeout: str, ttl: str, cooldown: str, kill_after: str) -> bool:
    """The documented rules for runlocked's options: the API's (``usable``), given as
    text, and ``--kill-after`` finite seconds, not negative."""
    try:
        whole = int(limit)
    except ValueError:
        return False
    waits, lasts, rests, stops = map(typed_seconds, (timeout, ttl, cooldown, kill_after))
    return (
        None not in (waits, lasts, rests, stops)
        and usable(whole, waits, lasts, rests)
        and 0 <= stops < math.inf  # type: ignore[operator]
    )


@FUZZ
@given(
    limit=mostly(st.sampled_from(["1", "2", " 3 "]), TYPED),
    timeout=mostly(st.sampled_from(["0", "0.5", "inf", "1e309"]), TYPED),
    ttl=mostly(st.sampled_from(["0.3", "30", "1_0"]), TYPED),
    cooldown=mostly(st.sampled_from(["0", "-0", "0.01"]), TYPED),
    kill_after=mostly(st.sampled_from(["0", "10", "2.5"]), TYPED),
)
def test_any_numbers_work_or_get_exit_2_through_runlocked(
    limit: str,
    timeout: str,
    ttl: str,
    cooldown: str,
    kill_after: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = next(names)
    options = {
        "--limit": limit,
        "--timeout": timeout,
        "--ttl": ttl,
        "--cooldown": cooldown,
        "--kill-after": kill_after,
    }
    typed = [f"{option}={value}" for option, value in options.items()]  # "-1" is a value
    with pytest.raises(SystemExit) as ended:
        RunLockedCommand().run_from_argv(["manage.py", "runlocked", name, *typed, "--", "true"])
    said = capsys.readouterr().err
    if typed_usable(limit, timeout, ttl, cooldown, kill_after):
        event("ran")
        assert ended.value.code == 0, said
    else:
        event("refused")
        assert ended.value.code == 2, said
        assert "Traceback" not in said and said.strip(), said
    assert backends["default"].holders(name) == []
    assert backends["default"].waiters(name) == []
