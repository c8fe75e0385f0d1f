"""Tracing: a tracer provider per app, and an exporter that can never slow a request.

Ended spans go into a bounded queue; one daemon thread exports them in batches. When the
collector is slow, down or a black hole, the queue fills and further spans are dropped
and counted (``ai_backend_dropped_spans_total``), instead of blocking the request path
or growing memory. Shutdown flushes what it can within a bounded time.
"""

from __future__ import annotations

import collections
import importlib.metadata
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from app.settings import MAX_BATCH, TelemetrySettings

log = logging.getLogger(__name__)

ATTRIBUTE_CHARS = 1024  # the longest span attribute value kept (longer ones are cut)


class BoundedSpanProcessor(SpanProcessor):
    """Queue ended spans (bounded, drop-and-count when full); export them off the request path."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue: int = 2048,
        batch_size: int = 256,
        schedule_delay_s: float = 1.0,
        on_drop: Callable[[int], None] = lambda count: None,
        export_timeout_s: float = 1.0,
    ) -> None:
        """``export_timeout_s``: the exporter's own bound on one export; a shutdown waits that
        long (and a little) for the export under way before it counts its spans as lost."""
        self._exporter = exporter
        self._export_timeout_s = export_timeout_s
        self._exporting = 0  # spans in the export under way on the thread
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._delay = schedule_delay_s
        self._on_drop = on_drop
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._last_error_log = 0.0
        self.dropped = 0
        self._overflowed = 0  # of those, spans that found the queue full (told by the export thread)
        self._overflow_told = 0
        self._thread = threading.Thread(target=self._work, name="span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled or self._stopping:
            return
        with self._lock:
            if len(self._queue) >= self._max_queue:
                self.dropped += 1
                self._overflowed += 1
                full = True
            else:
                self._queue.append(span)
                full = False
                ready = len(self._queue) >= self._batch_size
        if full:
            self._on_drop(1)
        elif ready:
            self._wake.set()

    def _take(self) -> list[ReadableSpan]:
        with self._lock:
            count = min(self._batch_size, len(self._queue))
            return [self._queue.popleft() for _ in range(count)]

    def _export(self, batch: Sequence[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(batch)
        except Exception as exc:  # a broken collector must not kill the export thread
            result = SpanExportResult.FAILURE
            error: object = exc
        else:
            error = "exporter reported failure"
        if result is SpanExportResult.SUCCESS:
            return
        self._lost(len(batch))  # the collector refused them, or could not be reached
        self._warn(f"span export failed ({error}); {self.dropped} spans dropped so far")

    def _warn(self, message: str) -> bool:
        """A warning at most once a minute (on the export thread: never on the request path);
        True when this one was written."""
        if time.monotonic() - self._last_error_log <= 60:
            return False
        self._last_error_log = time.monotonic()
        log.warning("%s", message)
        return True

    def _tell_overflow(self) -> None:
        """Spans dropped because the queue was full: a collector that answers but too slowly,
        or spans made faster than any export, lose spans with no failed export to say so."""
        overflowed = self._overflowed
        if overflowed > self._overflow_told and self._warn(
            f"span queue full (telemetry.max_queue={self._max_queue}): {overflowed - self._overflow_told} "
            f"spans dropped since the last warning, {self.dropped} in all; spans are made faster than they export"
        ):
            self._overflow_told = overflowed

    def _lost(self, count: int) -> None:
        with self._lock:
            self.dropped += count
        self._on_drop(count)

    def _work(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay)
            self._wake.clear()
            self._tell_overflow()
            while batch := self._take():
                self._exporting = len(batch)
                self._export(batch)
                self._exporting = 0
                if self._stopping:
                    return

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        while time.monotonic() < deadline:
            batch = self._take()
            if not batch:
                return True
            self._export(batch)
        return False

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=self._export_timeout_s + 0.5)
        if not self.force_flush(2_000):  # what is queued, beside an export that may still be on
            with self._lock:
                left = len(self._queue)
                self._queue.clear()
            self._lost(left)
            log.warning("span export ran out of time at shutdown: %d spans dropped", left)
        if self._thread.is_alive() and (stuck := self._exporting):
            # an export past the exporter's own timeout and the flush: the process exits with it
            self._lost(stuck)
            log.warning("span export still under way at shutdown: %d spans dropped", stuck)
        self._exporter.shutdown()


DEFAULT_EXPORT_TIMEOUT_S = 5.0  # one export's bound where neither our setting nor the OTLP variables give one
TRACES_PATH = "/v1/traces"  # the OTLP/HTTP traces path, under a base URL


def export_timeout_s(settings: TelemetrySettings) -> float:
    """One export's bound, in seconds: ``telemetry.export_timeout_s`` where it is set, else
    ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``, else ``OTEL_EXPORTER_OTLP_TIMEOUT`` (in seconds, as
    OpenTelemetry's Python exporters read them), else 5. The exporter and the processor's
    shutdown wait both use it. The first variable set that is not a number of seconds in
    (0, 3600] is warned of, and 5 used (3600 is the setting's own bound; a value meant in
    milliseconds, as the specification has it, would otherwise hold a shutdown for hours)."""
    if settings.export_timeout_s is not None:
        return settings.export_timeout_s
    for name in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        if not (text := os.environ.get(name, "").strip()):
            continue
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if 0 < seconds <= 3600:
            return seconds
        log.warning(
            "%s=%s is not a number of seconds in (0, 3600] (the Python exporters read it in seconds): %g s used",
            name,
            text[:64],
            DEFAULT_EXPORT_TIMEOUT_S,
        )
        break
    return DEFAULT_EXPORT_TIMEOUT_S


def grpc_insecure(endpoint: str | None) -> bool | None:
    """What the gRPC exporter is told of TLS; ``None`` leaves it to the exporter, which reads
    ``OTEL_EXPORTER_OTLP_[TRACES_]INSECURE``. Unset ``endpoint``: the exporter decides all of it
    (its endpoint too, from ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``). ``http://``: plaintext,
    ``https://``: TLS (the scheme decides, as the specification says; with ``False`` the exporter
    reads the ``..._CERTIFICATE``, ``..._CLIENT_KEY`` and ``..._CLIENT_CERTIFICATE`` variables,
    the traces' own included). ``HOST:PORT``: the ``..._INSECURE`` variables decide where one is
    set; plaintext where none is (as this setting always was; the exporter alone would use TLS)."""
    if endpoint is None:
        return None
    scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""
    if scheme == "http":
        return True
    if scheme == "https":
        return False
    if any(os.environ.get(name) for name in ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")):
        return None
    return True


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL spans are posted to: ``endpoint`` itself where its path ends in
    ``/v1/traces`` (a traces URL, as ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` takes), else
    ``/v1/traces`` under it (a base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes; a path before
    it stays: a collector behind a proxy's prefix)."""
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def make_exporter(settings: TelemetrySettings, timeout_s: float | None = None) -> SpanExporter | None:
    """The configured exporter. The OTLP exporters read their standard ``OTEL_EXPORTER_OTLP_*``
    variables for what our settings leave unset: the endpoint (``telemetry.endpoint`` unset),
    the timeout (``export_timeout_s``, unless ``timeout_s`` is given), TLS (``grpc_insecure``),
    headers and compression."""
    if settings.exporter == "none":
        return None
    if settings.exporter == "console":  # a span a line on stdout, as the JSON logs on stderr: one stream in a container
        return ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + os.linesep)
    timeout = export_timeout_s(settings) if timeout_s is None else timeout_s
    if settings.exporter == "otlp_grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=settings.endpoint, insecure=grpc_insecure(settings.endpoint), timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = traces_url(settings.endpoint) if settings.endpoint else None
    return HttpExporter(endpoint=endpoint, timeout=timeout)


class FollowsLinks(Sampler):
    """A root span with links (a batch, linked to its requests) is sampled when any request it
    links to was, and dropped when none was: a batch must be in the trace store whenever a
    request's ``inference`` span points at it, and never alone. Other root spans are sampled
    by ``ratio`` on their trace id."""

    def __init__(self, ratio: float) -> None:
        self._ratio = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if links:
            sampled = any(link.context.trace_flags.sampled for link in links)
            decision = Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP
            return SamplingResult(decision, attributes if sampled else None, trace_state)
        return self._ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"FollowsLinks{{{self._ratio.get_description()}}}"


def _resource(service_name: str) -> Resource:
    """Who emits the spans: the service's name, and which replica and release of it, so that a
    trace leads to the pod whose logs and metrics hold the rest (in Kubernetes the host name is the
    pod's). ``OTEL_RESOURCE_ATTRIBUTES`` may say more, or otherwise, but for the name."""
    try:
        version = importlib.metadata.version("ai-backend")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that was never installed
        version = "unknown"
    replica = Resource({"service.version": version, "host.name": socket.gethostname()})
    return replica.merge(Resource.create({"service.name": service_name}))


def build_tracer_provider(
    settings: TelemetrySettings,
    exporter: SpanExporter | None = None,
    on_drop: Callable[[int], None] = lambda count: None,
) -> tuple[TracerProvider, BoundedSpanProcessor | None]:
    """A provider with a parent-based sampler (root spans: ``FollowsLinks``) and (unless
    ``none``) the bounded processor."""
    provider = TracerProvider(
        resource=_resource(settings.service_name),
        sampler=ParentBased(FollowsLinks(settings.sampling_ratio)),
        # a batch span links each of its requests: the SDK's default of 128 links would leave
        # the rest of a larger batch with no way back from it
        # and no attribute longer than ATTRIBUTE_CHARS: a URL or a User-Agent is the client's, and
        # spans queued for a collector that does not answer held whole 30 KB query strings
        span_limits=SpanLimits(max_links=MAX_BATCH, max_span_attribute_length=ATTRIBUTE_CHARS),
    )
    if exporter is None and settings.exporter == "none":
        return provider, None
    timeout_s = export_timeout_s(settings)  # once: a variable it ignores is warned of once
    exporter = exporter or make_exporter(settings, timeout_s)
    if exporter is None:
        return provider, None
    processor = BoundedSpanProcessor(
        exporter,
        max_queue=settings.max_queue,
        batch_size=settings.batch_size,
        schedule_delay_s=settings.schedule_delay_ms / 1000,
        on_drop=on_drop,
        export_timeout_s=timeout_s,
    )
    provider.add_span_processor(processor)
    return provider, processor


QUERY_KEPT = frozenset({"top_k"})  # the query parameters the API reads: their values are no secret


def query_redacted(span: trace.Span, scope: dict[str, Any]) -> None:
    """The HTTP server span's hook: the URL it records keeps the query parameters the API reads,
    and of the rest only the mark ``REDACTED`` (a credential a client put there by mistake, as a
    value or as a name); the access log keeps no query at all."""
    query = scope.get("query_string")
    if not query or not span.is_recording():
        return
    pairs = urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    kept = urllib.parse.urlencode([(name, value) for name, value in pairs if name in QUERY_KEPT])
    if len(kept.split("&")) < len(pairs) or not kept:  # the rest, names too (a token may be one), as one mark
        kept = f"{kept}&REDACTED" if kept else "REDACTED"
    for key in ("http.url", "url.full"):
        url = getattr(span, "attributes", {}).get(key)
        if isinstance(url, str):
            span.set_attribute(key, f"{url.partition('?')[0]}?{kept}")
    if "url.query" in getattr(span, "attributes", {}):
        span.set_attribute("url.query", kept)
