"""JSON logs, one object a line, carrying the request id of the request being served.

The request id lives in a context variable set by the request middleware, so every log
line written while serving a request carries it without being passed around. Payloads
never go into a log record: only ids, sizes, timings and codes.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import math
import sys
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
# With tracing off, the caller's W3C trace context (trace id, parent span id), so that log
# lines still join the trace an upstream service recorded.
caller_trace_var: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("caller_trace", default=None)

# attributes every LogRecord has; anything else was passed through ``extra=`` and is a field
_STANDARD = logging.LogRecord("", 0, "", 0, "", None, None).__dict__
_RESERVED = set(_STANDARD) | {
    "message",
    "asctime",
    "request_id",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}
_ENCODER = json.JSONEncoder(default=str)  # json.dumps(default=...) would build one per line

# A record's own attributes come first in its __dict__ (``extra=`` may not replace them, and
# is applied after they are set): the fields start after them.
_FIRST_EXTRA = len(_STANDARD)


class RequestIdFilter(logging.Filter):
    """Stamps the current request id, trace id and span id onto each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        if hasattr(record, "trace_id"):
            return True
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        elif (caller := caller_trace_var.get()) is not None:
            record.trace_id, record.span_id = caller
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: timestamp, level, logger, message, request_id, then extras.

    Every request writes an access line, so this is on the hot path: the timestamp's date
    and time of day are formatted once a second, and only the attributes past a record's
    own are looked at for fields.
    """

    _second: tuple[int | None, str] = (None, "")  # the last second formatted, and its text

    def timestamp(self, created: float) -> str:
        """``created`` (seconds since the epoch) as ISO 8601 in UTC, to the millisecond, as
        ``datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")`` has it."""
        fraction, whole = math.modf(created)
        micros = round(fraction * 1e6)  # rounded to the microsecond first, as datetime does
        if micros < 0:  # before the epoch: modf keeps the sign
            whole, micros = whole - 1, micros + 1_000_000
        if micros >= 1_000_000:
            whole, micros = whole + 1, micros - 1_000_000
        second = int(whole)
        cached, text = self._second  # one read: another thread may replace it
        if cached != second:
            text = datetime.fromtimestamp(second, UTC).replace(tzinfo=None).isoformat(timespec="seconds")
            self._second = (second, text)
        return f"{text}.{micros // 1000:03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": self.timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        for key, value in itertools.islice(record.__dict__.items(), _FIRST_EXTRA, None):
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _ENCODER.encode(entry)


class PlainFormatter(logging.Formatter):
    """Text lines for a terminal, one a record: what a message carries from a client (a path with
    an encoded newline, say) cannot start a line of its own that reads as another record. Line
    breaks and other control characters are escaped (a traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return super().formatMessage(record).translate(_CONTROL)


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def configure_logging(level: str, json_format: bool) -> None:
    """Route the root logger (and uvicorn's) to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainFormatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    logging.captureWarnings(True)
    # The logging HOWTO's optimisations: no caller frame looked up, no thread or process fields
    # (no line shows them); microseconds off every line, and the access log writes one per request
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Pillow logs a line for every chunk of a PNG it reads: at DEBUG, one crafted image made 40,000
    # lines (with no request id: decodes run on the batch's thread). It keeps INFO and above
    logging.getLogger("PIL").setLevel(max(logging.INFO, logging.getLevelName(level.upper())))
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # our middleware writes the access log
