"""OpenTelemetry spans around acquires (``djlocks.tracing``), recorded by the SDK's
in-memory exporter as a project's configured tracer provider would export them."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.exceptions import ImproperlyConfigured
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from djlocks import Lock, async_waits, tracing

pytestmark = pytest.mark.usefixtures("store")

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
trace.set_tracer_provider(PROVIDER)  # once per process, as a project configures it


@pytest.fixture
def spans() -> InMemorySpanExporter:
    EXPORTER.clear()
    return EXPORTER


def test_an_acquire_is_a_span_with_the_name_the_backend_and_the_fence(
    spans: InMemorySpanExporter,
) -> None:
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("request") as request, Lock("traced:a", timeout=5) as grant:
        pass
    with Lock("traced:a", timeout=5):
        assert not Lock("traced:a").acquire(timeout=0)
    acquires = [span for span in spans.get_finished_spans() if span.name == "djlocks acquire"]
    assert len(acquires) == 3
    first = acquires[0]
    assert first.parent is not None and first.parent.span_id == request.get_span_context().span_id
    assert first.attributes is not None
    assert first.attributes["djlocks.name"] == "traced:a"
    assert first.attributes["djlocks.backend"] == "default"
    assert first.attributes["djlocks.limit"] == 1
    assert first.attributes["djlocks.granted"] is True
    assert first.attributes["djlocks.fence"] == grant.fence
    assert 0 <= float(first.attributes["djlocks.waited"]) < 5  # type: ignore[arg-type]
    refused = acquires[2]  # ends before the block that holds the name
    assert refused.attributes is not None and refused.attributes["djlocks.granted"] is False
    assert "djlocks.fence" not in refused.attributes


def test_an_acquire_that_fails_records_its_error(spans: InMemorySpanExporter) -> None:
    with pytest.raises(ImproperlyConfigured):
        Lock("traced:nowhere", backend="no-such-alias").acquire(timeout=0)
    (failed,) = spans.get_finished_spans()
    assert failed.status.status_code == StatusCode.ERROR
    assert [event.name for event in failed.events] == ["exception"]


def test_before_a_provider_is_configured_an_acquire_opens_no_span(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API's default provider records nothing: an acquire then costs no span (and
    makes no no-op span current, which would hide the caller's trace context)."""
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    # The answer "none" is believed for a second: after this test, the project's
    # provider again (monkeypatch restores the moment it is believed until).
    monkeypatch.setattr(tracing, "_unconfigured_until", 0.0)
    with Lock("traced:quiet", timeout=5):
        pass
    assert spans.get_finished_spans() == ()


def test_an_async_acquire_s_span_begins_when_its_task_asked(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its time queued for a wait thread (one here, taken for 0.6 s by another task's
    wait) is inside its span."""
    one_thread = ThreadPoolExecutor(1)
    monkeypatch.setattr(async_waits, "_threads", (os.getpid(), one_thread, one_thread))

    async def queue_behind_a_wait() -> None:
        first = asyncio.ensure_future(Lock("traced:held").aacquire(timeout=0.6))
        await asyncio.sleep(0.1)  # the first takes the only wait thread
        async with Lock("traced:free"):
            pass
        await first

    with Lock("traced:held"):
        asyncio.run(queue_behind_a_wait())
    one_thread.shutdown()
    (free,) = [
        s for s in spans.get_finished_spans() if s.attributes["djlocks.name"] == "traced:free"
    ]
    assert free.start_time is not None and free.end_time is not None
    assert (free.end_time - free.start_time) / 1e9 >= 0.4, "the span began in the wait thread"
