"""OpenTelemetry spans around acquires (the ``[otel]`` extra).

With ``opentelemetry-api`` installed, every acquire runs inside a span named
``djlocks acquire`` from the tracer ``djlocks``, so that the time a request or
a task spent waiting for a lock shows in its trace, with the database calls
the wait made as children. Attributes: ``djlocks.name``, ``djlocks.backend``,
``djlocks.limit``, ``djlocks.granted`` and, for a grant, ``djlocks.fence``,
``djlocks.slot`` and ``djlocks.waited`` (seconds). An acquire that raises
records the exception on its span. Until the project configures a tracer
provider (the OpenTelemetry SDK), whose spans would record nothing, no span is
opened (a provider configured after the first acquires is used within a second);
without the package, nothing is done at all.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from djlocks.grant import Grant

try:
    import opentelemetry.trace as trace
except ImportError:  # the [otel] extra is not installed
    trace = None  # type: ignore[assignment]

#: The API's providers before the project configures one (the OpenTelemetry SDK):
#: their spans record nothing, so an acquire opens none. (A no-op span made current
#: would also hide, inside the wait, a trace context propagated from upstream.)
_RECORDING_NOTHING = () if trace is None else (trace.ProxyTracerProvider, trace.NoOpTracerProvider)

#: Called with the acquire's grant (``None``: not granted) before its span ends.
Outcome = Callable[["Grant | None"], None]


def acquiring(
    backend: str, name: str, limit: int, began: float | None = None
) -> AbstractContextManager[Outcome]:
    """The span of one acquire of ``name`` (``limit`` slots) on the alias ``backend``,
    which began at ``began`` (``time.monotonic()``; ``None``: now, as the span opens);
    none until a tracer provider is configured (``_configured``)."""
    if trace is None or not _configured():
        return _NOT_TRACED
    return _span(backend, name, limit, began)


#: Seconds for which "no tracer provider is configured" is believed: asking the API
#: reads the process's environment each time (``OTEL_PYTHON_TRACER_PROVIDER``), as
#: much work as the rest of a span-less acquire's tracing. A provider configured later
#: is used from this long after, at most.
UNCONFIGURED_RECHECK = 1.0
#: Until when (``time.monotonic()``) no tracer provider is believed configured.
_unconfigured_until = 0.0


def _configured() -> bool:
    """Whether the project configured a tracer provider whose spans record."""
    global _unconfigured_until
    now = time.monotonic()
    if now < _unconfigured_until:
        return False
    if isinstance(trace.get_tracer_provider(), _RECORDING_NOTHING):
        _unconfigured_until = now + UNCONFIGURED_RECHECK
        return False
    return True


@contextlib.contextmanager
def _span(backend: str, name: str, limit: int, began: float | None) -> Iterator[Outcome]:
    attributes: dict[str, str | int] = {
        "djlocks.name": name,
        "djlocks.backend": backend,
        "djlocks.limit": limit,
    }
    # OpenTelemetry takes a start in nanoseconds of the wall clock.
    start = None if began is None else time.time_ns() - round((time.monotonic() - began) * 1e9)
    with _tracer().start_as_current_span(
        "djlocks acquire", attributes=attributes, start_time=start
    ) as span:

        def outcome(grant: Grant | None) -> None:
            span.set_attribute("djlocks.granted", grant is not None)
            if grant is not None:
                span.set_attribute("djlocks.fence", grant.fence)
                span.set_attribute("djlocks.slot", grant.slot)
                span.set_attribute("djlocks.waited", grant.waited)

        yield outcome


@functools.cache
def _tracer() -> trace.Tracer:
    """The ``djlocks`` tracer: a proxy until a provider is set, then that provider's."""
    from djlocks import __version__

    return trace.get_tracer("djlocks", __version__)


def _ignore(grant: Grant | None) -> None:
    return None


#: What an acquire runs in while no span would record anything.
_NOT_TRACED: AbstractContextManager[Outcome] = contextlib.nullcontext(_ignore)
