"""Prometheus metrics of the lock operations of this process (the ``[prometheus]`` extra).

With ``prometheus_client`` installed, djlocks counts and times what its locks
do, in the client's default registry, and ``metrics_view`` (or ``manage.py
djlocks metrics``) exposes them. Without it, every hook here returns at once.

Every metric is labelled with ``backend`` (the alias) and ``group``: the name's
group, by default the part of the name before its first ``:`` (``render`` for
``render:42``), so that per-object names do not become one time series each.
``DJLOCKS["METRICS_GROUP"]`` names another function (``str -> str``). Under a
server that runs several processes (gunicorn), set ``PROMETHEUS_MULTIPROC_DIR``
as prometheus_client documents: ``metrics_view`` then adds up every process's
figures, and the gauges add the live processes' values.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.http import HttpRequest, HttpResponse
from django.utils.module_loading import import_string

from djlocks.conf import djlocks_settings

metrics_log = logging.getLogger("djlocks.metrics")

if TYPE_CHECKING:
    from djlocks.grant import Grant

try:
    import prometheus_client
except ImportError:  # the [prometheus] extra is not installed: nothing is measured
    prometheus_client = None  # type: ignore[assignment]

#: Histogram buckets (seconds) of waits and holds: from a millisecond to an hour.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 900, 3600)
#: Histogram buckets (seconds) of renewals: one round trip to a few seconds.
RENEWAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
LABELS = ("backend", "group")


def name_group(name: str) -> str:
    """The default ``METRICS_GROUP``: the part of ``name`` before its first ``:``."""
    return name.split(":", 1)[0]


@functools.cache
def _grouping(path: str | None) -> Callable[[str], str]:
    return name_group if path is None else import_string(path)


def group_of(name: str) -> str:
    """The ``group`` label of ``name`` (``DJLOCKS["METRICS_GROUP"]``); the default
    grouping's if that function fails (logged: a lock never fails for its metrics)."""
    try:
        return str(_grouping(djlocks_settings()["METRICS_GROUP"])(name))
    except Exception:
        metrics_log.warning("METRICS_GROUP failed for %r; grouped by default", name, exc_info=True)
        return name_group(name)


class _Metrics:
    """The metrics themselves, made once per process on first use."""

    def __init__(self, client: Any) -> None:
        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Any:
            return client.Histogram(name, text, LABELS, buckets=buckets)

        def counter(name: str, text: str) -> Any:
            return client.Counter(name, text, LABELS)

        def gauge(name: str, text: str) -> Any:
            return client.Gauge(name, text, LABELS, multiprocess_mode="livesum")

        self.wait = histogram(
            "djlocks_wait_seconds",
            "Seconds an acquire waited, until granted or given up.",
            DURATION_BUCKETS,
        )
        self.hold = histogram(
            "djlocks_hold_seconds",
            "Seconds a grant was held, until released or lost.",
            DURATION_BUCKETS,
        )
        self.renewal = histogram(
            "djlocks_renewal_seconds", "Seconds a renewal took at the store.", RENEWAL_BUCKETS
        )
        self.acquisitions = counter("djlocks_acquisitions", "Grants.")
        self.timeouts = counter(
            "djlocks_timeouts", "Acquires that ran out of time or were cancelled."
        )
        self.losses = counter("djlocks_losses", "Grants lost before their release.")
        self.forced_releases = counter(
            "djlocks_forced_releases", "Grants an operator released by force from this process."
        )
        self.holders = gauge("djlocks_holders", "Grants this process holds now.")
        self.waiters = gauge("djlocks_waiters", "Acquires of this process waiting now.")


@functools.cache
def _metrics() -> _Metrics:
    assert prometheus_client is not None
    return _Metrics(prometheus_client)


class _Series:
    """The time series of one (backend, group), looked up once: a lock operation
    then costs a few increments, not a label lookup each."""

    def __init__(self, metrics: _Metrics, labels: tuple[str, str]) -> None:
        self.wait = metrics.wait.labels(*labels)
        self.hold = metrics.hold.labels(*labels)
        self.renewal = metrics.renewal.labels(*labels)
        self.acquisitions = metrics.acquisitions.labels(*labels)
        self.timeouts = metrics.timeouts.labels(*labels)
        self.losses = metrics.losses.labels(*labels)
        self.forced_releases = metrics.forced_releases.labels(*labels)
        self.holders = metrics.holders.labels(*labels)
        self.waiters = metrics.waiters.labels(*labels)


@functools.lru_cache(maxsize=1024)
def _series_of(alias: str, group: str) -> _Series:
    return _Series(_metrics(), (alias, group))


def _series(alias: str, name: str) -> _Series:
    return _series_of(alias, group_of(name))


def enabled() -> bool:
    """Whether metrics are collected (``prometheus_client`` is installed)."""
    return prometheus_client is not None


#: Called once an acquire ends, with whether it was granted (``None``: it failed) and
#: how long (seconds) it waited; returns the series a grant's end goes to, if granted.
Ended = Callable[[bool | None, float], object]


def waiting(alias: str, name: str) -> Ended:
    """An acquire of ``name`` on ``alias`` begins; call the result once it ends, and
    keep what it returns for a grant in ``Grant.measured_as``."""
    if prometheus_client is None:
        return _ignore
    series = _series(alias, name)
    series.waiters.inc()

    def ended(granted: bool | None, waited: float) -> object:
        series.waiters.dec()
        if granted is None:
            return None
        series.wait.observe(waited)
        if not granted:
            series.timeouts.inc()
            return None
        series.acquisitions.inc()
        series.holders.inc()
        return series

    return ended


def _ignore(granted: bool | None, waited: float) -> object:
    return None


def grant_ended(series: object, held: float, lost: bool) -> None:
    """A grant counted in ``series`` (what ``waiting``'s callback returned for it) ended
    after ``held`` seconds: released, or ``lost``. Call it once per grant; its end goes
    to the series it was counted in, whatever the grouping now."""
    if not isinstance(series, _Series):
        return
    series.holders.dec()
    series.hold.observe(held)
    if lost:
        series.losses.inc()


def renewed(grant: Grant, took: float) -> None:
    """A renewal of ``grant`` took ``took`` seconds at its store."""
    if prometheus_client is not None:
        _series(grant.spec.backend_alias, grant.name).renewal.observe(took)


def released_by_force(alias: str, name: str, count: int) -> None:
    """An operator of this process released ``count`` grants of ``name`` by force."""
    if prometheus_client is not None and count:
        _series(alias, name).forced_releases.inc(count)


def exposition() -> tuple[bytes, str]:
    """The metrics in Prometheus' text format, and its content type: this process's,
    or every process's under ``PROMETHEUS_MULTIPROC_DIR``. Raises ``ImproperlyConfigured``
    without the ``[prometheus]`` extra."""
    if prometheus_client is None:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            "djlocks metrics need prometheus_client: pip install 'djlocks[prometheus]'."
        )
    _metrics()  # every metric exists, even before the first lock operation
    registry: Any = prometheus_client.REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST


def metrics_view(request: HttpRequest) -> HttpResponse:
    """A Django view for Prometheus to scrape: ``path("metrics/", metrics_view)``.

    It shows what it is given, so route it where only the scraper can reach it (an
    internal port, or behind your own authentication)."""
    body, content_type = exposition()
    return HttpResponse(body, content_type=content_type)
