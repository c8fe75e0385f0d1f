"""The span processor never blocks the request path: a stuck exporter costs dropped spans, not time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from app.settings import TelemetrySettings
from app.telemetry.tracing import BoundedSpanProcessor, build_tracer_provider, make_exporter


class StuckExporter(SpanExporter):
    """A collector that accepts the connection and never answers (until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.exported: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        self.exported += [s.name for s in spans]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def pipeline(
    exporter: SpanExporter, max_queue: int = 10, batch_size: int = 1, delay_s: float = 0.01
) -> tuple[BoundedSpanProcessor, TracerProvider, list[int]]:
    """A provider exporting through the bounded processor, and the drops it reported."""
    drops: list[int] = []
    processor = BoundedSpanProcessor(
        exporter, max_queue=max_queue, batch_size=batch_size, schedule_delay_s=delay_s, on_drop=drops.append
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    return processor, provider, drops


def test_a_stuck_exporter_fills_the_bounded_queue_and_drops_are_counted() -> None:
    exporter = StuckExporter()
    processor, provider, drops = pipeline(exporter)
    tracer = provider.get_tracer("test")
    tracer.start_span("first").end()
    assert exporter.entered.wait(5), "the export thread took the first span and is now stuck"
    for i in range(50):
        tracer.start_span(f"span-{i}").end()  # returns at once though the exporter hangs
    assert processor.dropped == 40 and sum(drops) == 40
    exporter.release.set()
    assert processor.force_flush(5_000)
    provider.shutdown()
    assert "first" in exporter.exported and len(exporter.exported) == 11


def test_unsampled_spans_are_not_queued() -> None:
    settings = TelemetrySettings(exporter="console", sampling_ratio=0.0)
    exporter = StuckExporter()
    exporter.release.set()
    provider, processor = build_tracer_provider(settings, exporter)
    provider.get_tracer("test").start_span("never").end()
    assert processor is not None and processor.force_flush(1_000)
    provider.shutdown()
    assert exporter.exported == []


def test_a_clients_long_url_is_cut_in_the_span_that_waits_for_export() -> None:
    """A URL or a User-Agent is the client's: spans queued for a collector that did not answer
    held whole 30 KB query strings (174 MiB of the server's memory over 2,300 requests)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from app.telemetry.tracing import ATTRIBUTE_CHARS

    exporter = InMemorySpanExporter()
    provider, processor = build_tracer_provider(TelemetrySettings(exporter="console"), exporter)
    provider.get_tracer("test").start_span("GET /predict", attributes={"http.url": "x" * 30_000}).end()
    assert processor is not None and processor.force_flush(1_000)
    provider.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None and len(str(span.attributes["http.url"])) == ATTRIBUTE_CHARS == 1024


def test_exporters_by_setting() -> None:
    assert make_exporter(TelemetrySettings()) is None
    assert type(make_exporter(TelemetrySettings(exporter="console"))).__name__ == "ConsoleSpanExporter"
    grpc = make_exporter(TelemetrySettings(exporter="otlp_grpc", endpoint="http://127.0.0.1:4317"))
    http = make_exporter(TelemetrySettings(exporter="otlp_http", endpoint="http://127.0.0.1:4318"))
    assert type(grpc).__module__.endswith("grpc.trace_exporter")
    assert type(http).__module__.endswith("http.trace_exporter")
    for exporter in (grpc, http):
        assert exporter is not None
        exporter.shutdown()


class RefusingExporter(SpanExporter):
    """A collector that answers, and refuses every batch (a 503, a bad gateway)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        return None


def test_spans_a_collector_refuses_are_counted_as_dropped() -> None:
    processor, provider, drops = pipeline(RefusingExporter(), max_queue=100, batch_size=10, delay_s=60)
    tracer = provider.get_tracer("test")
    for i in range(30):
        tracer.start_span(f"span-{i}").end()
    provider.force_flush()
    provider.shutdown()
    assert processor.dropped == 30 and sum(drops) == 30


class SlowExporter(SpanExporter):
    """A collector slower than the shutdown's flush budget (2 s) for every batch."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        threading.Event().wait(2.5)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def test_spans_left_when_shutdown_runs_out_of_time_are_counted_as_dropped() -> None:
    exporter = SlowExporter()
    processor, provider, drops = pipeline(exporter)
    tracer = provider.get_tracer("test")
    tracer.start_span("first").end()
    assert exporter.entered.wait(5)
    for i in range(5):
        tracer.start_span(f"span-{i}").end()  # queued behind the slow export
    processor.shutdown()  # one more batch fits in its flush budget, at most; the rest is lost
    assert processor.dropped >= 3 and sum(drops) == processor.dropped
    assert processor.dropped + exporter.exported == 6


class UnfinishedExporter(StuckExporter):
    """A collector that takes longer than the exporter's timeout, shutdown or not."""

    def shutdown(self) -> None:
        return None


def test_spans_still_being_exported_when_the_process_exits_are_counted_as_dropped() -> None:
    exporter = UnfinishedExporter()
    drops: list[int] = []
    processor = BoundedSpanProcessor(
        exporter, batch_size=2, schedule_delay_s=0.01, on_drop=drops.append, export_timeout_s=0.1
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    tracer.start_span("first").end()
    tracer.start_span("second").end()
    assert exporter.entered.wait(5), "the export thread took both and is sending them"
    try:
        processor.shutdown()  # waits the export's timeout and a little, then the process may exit
        assert processor.dropped == 2 and drops == [2], "the batch the exit cuts off is counted"
    finally:
        exporter.release.set()


def test_spans_dropped_on_a_full_queue_are_told_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    # a collector that answers, slowly: no export fails, so only the queue knows spans were lost
    exporter = StuckExporter()
    processor, provider, _ = pipeline(exporter)
    tracer = provider.get_tracer("test")
    with caplog.at_level(logging.WARNING, logger="app.telemetry.tracing"):
        tracer.start_span("first").end()
        assert exporter.entered.wait(5)
        for i in range(50):
            tracer.start_span(f"span-{i}").end()
        exporter.release.set()  # the export thread goes on, and says what the queue dropped
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    provider.shutdown()
    assert processor.dropped == 40
    (record,) = caplog.records
    assert "span queue full (telemetry.max_queue=10): 40 spans dropped" in record.getMessage()


def test_the_resource_names_the_replica_and_the_release_and_the_environment_may_say_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Several pods export to one Jaeger: a trace must lead to the pod whose logs hold the rest."""
    import importlib.metadata
    import socket

    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    provider, _ = build_tracer_provider(TelemetrySettings(exporter="none"))
    attributes = provider.resource.attributes
    assert attributes["service.name"] == TelemetrySettings().service_name
    assert attributes["host.name"] == socket.gethostname()
    assert attributes["service.version"] == importlib.metadata.version("ai-backend")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=pod-7,k8s.namespace.name=serving")
    provider, _ = build_tracer_provider(TelemetrySettings(exporter="none"))
    assert (provider.resource.attributes["host.name"], provider.resource.attributes["k8s.namespace.name"]) == (
        "pod-7",
        "serving",
    )


@pytest.mark.parametrize(
    ("query", "kept"),
    [
        (b"top_k=2", "top_k=2"),
        (b"top_k=a%26b", "top_k=a%26b"),  # written back encoded, not as two parameters
        (b"sk_live_51abc", "REDACTED"),  # a bare token: a name with no value
        (b"top_k=3&api_key=secret&sk_live_51abc=", "top_k=3&REDACTED"),
    ],
)
def test_a_spans_url_keeps_top_k_and_marks_the_rest_without_names(query: bytes, kept: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider as Provider

    from app.telemetry.tracing import query_redacted

    # the older attribute, and the stable one (OTEL_SEMCONV_STABILITY_OPT_IN=http)
    attributes = {"http.url": "http://h/predict?" + query.decode(), "url.query": query.decode()}
    span = Provider().get_tracer("t").start_span("s", attributes=attributes)
    query_redacted(span, {"query_string": query})  # type: ignore[arg-type]
    assert span.attributes["http.url"] == f"http://h/predict?{kept}"  # type: ignore[index]
    assert span.attributes["url.query"] == kept  # type: ignore[index]
