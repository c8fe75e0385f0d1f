"""The answers an HTTP connection's protocol gives itself, to what it will not read as a request.

Bytes that are not HTTP/1.1 (or a body longer than its Content-Length) are a ``400
invalid_http``; a head too slow to come a ``408``, too large a ``431``, of an HTTP version other
than 1.x a ``505`` (or a ``400`` with no Host or two). Nothing more is read from the connection:
the requests before it are answered first, then this answer, in the error envelope with the
client's X-Request-ID where its head gave one, and the connection closes (lingering, as
``app.lingering_close`` says). Its access line names the request's method and path where its
request line came whole, and is timed from its first byte.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from app.api.middleware import ARRIVED, new_request_id, request_id_from
from app.api.schemas import ErrorResponse
from app.lingering_close import LingeringProtocol


class RefusingProtocol(LingeringProtocol):
    """uvicorn's httptools protocol, answering what it refuses to read after the requests
    before it; ``ClosingProtocol`` (``app.connection``) parses, times and bounds the heads, and
    says when one is refused (``_refuse_head``)."""

    _started: RequestResponseCycle | None = None  # the request whose app task started last
    _completed: RequestResponseCycle | None = None  # the last request whose bytes all arrived
    _in_head = False  # between a request's first byte and the end of its headers
    _invalid = False  # bytes that are not HTTP arrived: answered 400 after the requests before them
    _broken: RequestResponseCycle | None = None  # the request whose body broke, if a body did
    _invalid_at = 0.0  # perf_counter when they arrived
    _invalid_answer = (400, "invalid_http", "the request is not valid HTTP/1.1")  # what they get
    _head_id: str | None = None  # the client's X-Request-ID in a head refused before it was whole
    _head_refused = False  # the answer ``_stop_reading`` gives is to a request whose head was refused
    _line_whole = False  # the head's request line has arrived whole (a CRLF of the head came)
    _line_ended = False  # the last read of the head ended a line (with CRLF)

    def _unanswered(self) -> bool:
        """A request on this connection is running, or waits behind one (pipelined)."""
        return bool(self.pipeline) or (self._started is not None and not self._started.response_complete)

    def send_400_response(self, msg: str) -> None:
        """Bytes that are not HTTP/1.1 (or a body longer than its Content-Length). uvicorn answers
        a plain-text 400 at once and closes, even while a request before them, pipelined on the
        same connection, is still being answered: the client read the 400 as that request's
        answer. Here the requests before it are answered first, then the 400, in the envelope."""
        if self._invalid:
            return
        # its body is what broke (a request answered before its body came, refused at the edge or
        # by the app, keeps ``more_body`` though its body is whole: ``_completed`` tells)
        cycle = self.cycle
        if self._in_head:  # a head that breaks
            self._head_refused_now()
        self._stop_reading(cycle if cycle is not None and cycle.more_body and cycle is not self._completed else None)

    def _stop_reading(self, broken: RequestResponseCycle | None) -> None:
        """Read nothing more from this connection; answer ``_invalid_answer`` after the requests
        before it (``broken``, a request whose body broke, gets it as its own answer), then close."""
        self._invalid = True
        self._invalid_at = time.perf_counter()
        self.transport.pause_reading()
        self._broken = broken
        if broken is not None and broken is not self._started:  # queued behind another: never run it
            self.pipeline = type(self.pipeline)(entry for entry in self.pipeline if entry[0] is not broken)
        if broken is not None and broken is self._started:
            if broken.response_complete:  # answered already (refused at the edge before its body came)
                self.transport.close()
                return
            self._answer_invalid()  # its own answer: the app, still waiting for the body, is cut off
            broken.disconnected = True  # nothing it sends goes out; its receive says the client went
            broken.message_event.set()
            self.close_answered()
            return
        if not self._unanswered():
            self._answer_invalid()
            self.close_answered()

    def _answer_invalid(self) -> None:
        if self.transport.is_closing():
            return
        broken = self._broken
        scope = cast("dict[str, Any] | None", broken.scope if broken is not None else None)
        state: dict[str, Any] = scope.setdefault("state", {}) if scope is not None else {}
        request_id = state.get("request_id") or (
            request_id_from(scope) if scope is not None else (self._head_id or new_request_id())
        )
        served = broken is not None and broken is self._started  # its app task runs: it counts the answer
        status, code, message = self._invalid_answer
        if served:
            state.update(request_id=request_id, answered_as=(status, code))
        envelope = ErrorResponse(code=code, message=message, request_id=request_id)
        body = envelope.model_dump_json(exclude_none=True).encode()
        head = [STATUS_LINE[status]]
        for name, value in [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
            *([(b"x-trace-id", state["trace_id"].encode())] if state.get("trace_id") else []),
            (b"connection", b"close"),
        ]:
            head += [name, b": ", value, b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        if not served:
            # timed from the request's first byte, as every answer is (a 408's head took 15 s)
            head_scope = cast("dict[str, Any]", self.scope) if self._head_refused else None
            began = next((s["state"][ARRIVED] for s in (scope, head_scope) if s and ARRIVED in s["state"]), None)
            self.answered_invalid(scope or head_scope, request_id, began or self._invalid_at, status, code)

    def answered_invalid(
        self,
        scope: dict[str, Any] | None,
        request_id: str,
        started: float,
        status: int = 400,
        code: str = "invalid_http",
    ) -> None:
        """An ``invalid_http`` 400 no app task counts is written (``scope``: the request whose
        body broke, if one did, or whose head was refused, with its method and path where its
        request line came whole), or a request read whole that no app task will answer, its client
        gone (499 ``client_closed_request``). A protocol that knows the app counts it in its
        metrics and access log; an app task cut off by its own 400 counts it itself (``answered_as``)."""

    def _refuse_head(self, status: int, code: str, message: str) -> None:
        """A request whose head will not do (too slow, too large, of another HTTP version):
        answered once the requests before it are, then the connection closes; nothing more is
        read from it."""
        if not self._invalid:
            if self._in_head and self._line_ended:
                self._hand_over_last_header()
            self._invalid_answer = (status, code, message)
            self._head_refused_now()
            self._stop_reading(None)

    def _refuse_version(self, version: str) -> None:
        self._refuse_head(
            505, "http_version_not_supported", f"HTTP/{version} is not served here; send HTTP/1.1 (or HTTP/1.0)"
        )

    def _hand_over_last_header(self) -> None:
        """httptools hands a header to ``on_header`` only once the next line begins (or the head
        ends): a head cut off right after a whole header line (a 408) would lose that header, an
        X-Request-ID the answer echoes among them. A byte that begins a header name makes the
        parser hand it over; fed only when the last bytes received end a line, it cannot join
        the request line or a line still coming (the connection reads nothing more anyway)."""
        with contextlib.suppress(httptools.HttpParserError):
            self.parser.feed_data(b"X")

    def _head_refused_now(self) -> None:
        """Note the request whose head is refused: its id (the X-Request-ID its headers parsed so
        far give, else a fresh one), and its method and path for its access line, where its
        request line came whole (headers ended or began, or a line of the head ended)."""
        self._head_refused = True
        scope = cast("dict[str, Any]", self.scope)
        self._head_id = request_id_from(scope)
        if self._in_head and not (self._line_whole or self.headers):
            return  # the request line may be cut short, or the very thing that broke
        try:
            path = httptools.parse_url(self.url).path.decode("ascii")
            method = self.parser.get_method().decode("ascii")
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            return
        scope.update(method=method, path=self.root_path + (urllib.parse.unquote(path) if "%" in path else path))
