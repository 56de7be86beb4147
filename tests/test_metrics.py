"""The Prometheus metrics (``djlocks.metrics``), read back through the exposition format
a scraper parses: in this process, and added up over the processes of a stress run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client, override_settings
from prometheus_client.parser import text_string_to_metric_families

from djlocks import Lock, LockLost
from djlocks.backends import backends
from djlocks.inspection import force_release
from djlocks.metrics import exposition
from tests.processes import manage

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(text: str | None = None) -> Samples:
    """Every sample of the exposition (this process's, unless ``text`` is given)."""
    if text is None:
        text = exposition()[0].decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, group: str, backend: str = "default", **more: str) -> float:
    labels = tuple(sorted({"backend": backend, "group": group, **more}.items()))
    return samples.get((name, labels), 0.0)


def wait_for_renewals(before: Samples, count: int) -> None:
    """Wait until the heartbeat has renewed ``count`` grants of group "renewals" since
    ``before`` (the TTL leaves a late heartbeat time to renew before the lease ends)."""
    deadline = time.monotonic() + 30
    while renewals_in(scrape()) - renewals_in(before) < count:
        assert time.monotonic() < deadline, "the heartbeat did not renew the grant"
        time.sleep(0.05)


def renewals_in(samples: Samples) -> float:
    return value(samples, "djlocks_renewal_seconds_count", "renewals")


def test_each_lock_operation_is_counted_and_timed() -> None:
    before = scrape()
    with Lock("metrics:report:1", timeout=5):
        time.sleep(0.05)
    holder = Lock("metrics:report:2", timeout=5)
    assert holder.acquire()
    assert not Lock("metrics:report:2").acquire(timeout=0.1)
    force_release(backends["default"].holders("metrics:report:2"), operator="test")
    with pytest.raises(LockLost):
        holder.release()
    with Lock("renewals:1", ttl=1.5, timeout=5):  # a renewal every 0.5 s
        wait_for_renewals(before, 2)
    after = scrape()

    def grew(name: str, group: str = "metrics") -> float:
        return value(after, name, group) - value(before, name, group)

    assert grew("djlocks_acquisitions_total") == 2
    assert grew("djlocks_timeouts_total") == 1
    assert grew("djlocks_losses_total") == 1
    assert grew("djlocks_forced_releases_total") == 1
    assert grew("djlocks_wait_seconds_count") == 3
    assert 0.1 <= grew("djlocks_wait_seconds_sum") < 5  # the time-out waited 0.1 s
    assert grew("djlocks_hold_seconds_count") == 2
    assert 0.05 <= grew("djlocks_hold_seconds_sum") < 5
    assert grew("djlocks_holders") == 0 and grew("djlocks_waiters") == 0
    assert grew("djlocks_renewal_seconds_count", "renewals") >= 2
    assert 0 < grew("djlocks_renewal_seconds_sum", "renewals") < 5


def test_holders_and_waiters_are_gauges_of_this_process() -> None:
    with Lock("gauges:a", timeout=5):
        during = scrape()
    holders = value(during, "djlocks_holders", "gauges")
    assert holders == value(scrape(), "djlocks_holders", "gauges") + 1


def group_by_tenant(name: str) -> str:
    return name.rsplit("/", 1)[0]


def group_by_second_part(name: str) -> str:
    return name.split(":")[1]  # IndexError for a name without ":"


def test_a_grouping_that_fails_never_fails_the_lock() -> None:
    grouping = "tests.test_metrics.group_by_second_part"
    with override_settings(DJLOCKS={**settings.DJLOCKS, "METRICS_GROUP": grouping}):
        before = value(scrape(), "djlocks_acquisitions_total", "plainname")
        with Lock("plainname", timeout=5):
            pass
        assert value(scrape(), "djlocks_acquisitions_total", "plainname") == before + 1


def test_the_name_group_can_be_chosen() -> None:
    grouping = "tests.test_metrics.group_by_tenant"
    with override_settings(DJLOCKS={**settings.DJLOCKS, "METRICS_GROUP": grouping}):
        with Lock("tenant-7/export", timeout=5):
            pass
        assert value(scrape(), "djlocks_acquisitions_total", "tenant-7") == 1


@override_settings(ROOT_URLCONF="tests.metrics_urls")
def test_the_view_serves_the_exposition_format() -> None:
    with Lock("metrics:view", timeout=5):
        pass
    answer = Client().get("/metrics/")
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("text/plain; version=")
    assert value(scrape(answer.content.decode()), "djlocks_acquisitions_total", "metrics") >= 1


def test_a_stress_run_is_added_up_over_its_processes(tmp_path: Path) -> None:
    """``PROMETHEUS_MULTIPROC_DIR``: four worker processes take the lock 25 times each;
    ``djlocks metrics`` in another process reports their sum."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    stress = manage("djlocks", "stress", "--processes", "4", "--iterations", "25", env=env)
    assert stress.wait(100) == 0
    scraped = manage("djlocks", "metrics", env=env, stdout=-1)
    text, _ = scraped.communicate(timeout=60)
    assert scraped.returncode == 0
    samples = scrape(text)
    assert value(samples, "djlocks_acquisitions_total", "djlocks") == 100
    assert value(samples, "djlocks_wait_seconds_count", "djlocks") == 100
    assert value(samples, "djlocks_hold_seconds_count", "djlocks") == 100
    assert value(samples, "djlocks_holders", "djlocks") == 0  # every worker has exited
