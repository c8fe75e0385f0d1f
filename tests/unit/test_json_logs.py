"""The JSON formatter's shortcuts give exactly what the plain way gives; plain lines and console
spans stay a record a line."""

from __future__ import annotations

import io
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from app.settings import TelemetrySettings
from app.telemetry.logging import JsonFormatter, PlainFormatter
from app.telemetry.tracing import make_exporter


@given(st.floats(min_value=-1e9, max_value=4e9, allow_nan=False))
@example(1764534716.9999995)  # rounds up into the next second
@example(1764534716.0000004)
@example(-0.0000004)  # before the epoch: the fraction is negative
@example(-1.5)
@example(0.0)
def test_the_timestamp_is_datetimes_isoformat_to_the_millisecond(created: float) -> None:
    formatter = JsonFormatter()
    expected = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    assert formatter.timestamp(created) == expected
    assert formatter.timestamp(created) == expected, "the cached second gives the same text"


def _record(extra: dict[str, Any], **attributes: Any) -> logging.LogRecord:
    record = logging.getLogger("app.access").makeRecord(
        "app.access", logging.INFO, __file__, 1, "%s %s %d", ("POST", "/predict", 503), None, extra=extra
    )
    for name, value in attributes.items():  # what a filter sets, after the extras
        setattr(record, name, value)
    return record


def test_every_field_passed_or_stamped_is_written_and_nothing_of_the_records_own() -> None:
    extra = {"method": "POST", "status": 503, "duration_ms": 0.25, "timings_ms": {"total": 1.5}, "_private": 1}
    record = _record(extra, request_id="rid-1", trace_id="t" * 32, span_id="s" * 16)
    entry = json.loads(JsonFormatter().format(record))
    assert entry == {
        "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
        "level": "INFO",
        "logger": "app.access",
        "message": "POST /predict 503",
        "request_id": "rid-1",
        "method": "POST",
        "status": 503,
        "duration_ms": 0.25,
        "timings_ms": {"total": 1.5},
        "trace_id": "t" * 32,
        "span_id": "s" * 16,
    }
    assert list(entry)[5:] == ["method", "status", "duration_ms", "timings_ms", "trace_id", "span_id"]


def test_a_value_json_cannot_write_is_written_as_its_text() -> None:
    entry = json.loads(JsonFormatter().format(_record({"path": datetime(2026, 11, 30, tzinfo=UTC)})))
    assert entry["path"] == "2026-11-30 00:00:00+00:00" and entry["request_id"] is None


def test_plain_lines_escape_what_a_client_could_use_to_start_a_line_of_its_own() -> None:
    formatter = PlainFormatter("%(levelname)s %(message)s")
    forged = "/x\n2026-12-03 18:00:00,000 CRITICAL app.security admin token rotated\r\x1b[2J"
    record = logging.LogRecord("app.access", logging.INFO, __file__, 1, "GET %s", (forged,), None)
    line = formatter.format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line == "INFO GET /x\\n2026-12-03 18:00:00,000 CRITICAL app.security admin token rotated\\r\\x1b[2J"
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("app", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert formatter.format(failed).splitlines()[1] == "Traceback (most recent call last):", (
        "tracebacks keep their lines"
    )


def test_the_console_span_exporter_writes_a_span_a_line() -> None:
    exporter = make_exporter(TelemetrySettings(exporter="console"))
    assert isinstance(exporter, ConsoleSpanExporter)
    out = io.StringIO()
    exporter.out = out
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("one", attributes={"request.id": "r-1"}):
        pass
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["name"] == "one"


def test_debug_logs_the_service_not_a_line_for_every_chunk_of_a_png() -> None:
    """At DEBUG Pillow logged a line for every chunk of a PNG it read (a crafted 240 KB image made
    40,000 lines, none with a request id): it keeps INFO whatever the service's level."""
    from app.telemetry.logging import configure_logging

    root, pil, access = logging.getLogger(), logging.getLogger("PIL"), logging.getLogger("uvicorn.access")
    handlers, levels, disabled = root.handlers[:], (root.level, pil.level), access.disabled
    try:
        configure_logging("DEBUG", json_format=True)
        assert logging.getLogger("app.service").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("PIL.PngImagePlugin").isEnabledFor(logging.DEBUG)
        configure_logging("WARNING", json_format=True)
        assert not logging.getLogger("PIL.PngImagePlugin").isEnabledFor(logging.INFO), "never below the service's"
    finally:
        root.handlers[:], access.disabled = handlers, disabled
        root.setLevel(levels[0])
        pil.setLevel(levels[1])
