"""Overload refused by the HTTP protocol itself, before any ASGI work is done.

Under twice the load the service refuses more requests than it answers, and every CPU
cycle a refusal takes is one the decode and the device do not get. Refused by the
middleware (``app.api.shedding``), a prediction still cost uvicorn's task and ASGI cycle,
FastAPI's outer layers, a ``Request``, a ``JSONResponse`` and the ``send`` chain.

Here uvicorn's httptools protocol asks the same rules (``shed``) the moment a prediction's
headers are parsed and, when the answer is a 503, writes it itself: the same status,
headers and envelope, the same metrics and access line as the middleware would give. The
body that follows is read and dropped by the parser, and the connection stays open for the
client's next request. Anything the edge does not refuse, or cannot judge from the headers
alone, goes on to the app untouched (with its headers parsed once, for both). At twice the
load this answered 2-4% more requests (docs/performance.md, eighth pass).

It stands aside while spans are exported (a refusal then gets its server span from the
app's instrumentation) and when an API key is required (credentials are checked first).
Served by another ASGI server, the app refuses at the middleware as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import cast

from fastapi import FastAPI
from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from app.api.access_log import logged_path
from app.api.errors import retry_after
from app.api.middleware import (
    ARRIVED,
    caller_trace,
    draining,
    ends_connection,
    finish,
    identity_headers,
    request_id_from,
)
from app.api.routes.predict import predict_call
from app.api.schemas import ErrorResponse
from app.api.shedding import shed
from app.connection import ClosingProtocol
from app.telemetry.logging import caller_trace_var, request_id_var

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    """A refusal ready to write: the whole response, its status, whether the connection stays
    open after it, and the request's id and caller's trace (for its access line)."""

    response: bytes
    status: int
    keep_alive: bool
    request_id: str
    caller: tuple[str, str] | None


class Edge:
    """The refusals of one app, answered as bytes."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def refusal(self, scope: Scope, default_headers: list[tuple[bytes, bytes]], keep_alive: bool) -> Refusal | None:
        """The refusal of this request, or None: the app serves it."""
        call = predict_call(scope)
        state = self.app.state
        if call is None or getattr(state, "tracing", True):
            return None
        started = scope["state"].get(ARRIVED) or time.perf_counter()
        refused = shed(state, scope, call.name)
        if refused is None:
            scope["state"]["shed_checked"] = True  # the app's direct path need not ask again
            return None
        request_id = request_id_from(scope)
        caller = caller_trace(scope)
        scope["state"].update(request_id=request_id, started=started, route=call.template, error_code=refused.code)
        content = ErrorResponse(code=refused.code, message=refused.message, request_id=request_id)
        body = content.model_dump_json(exclude_none=True).encode()
        headers = [
            *default_headers,
            (b"retry-after", str(retry_after(refused)).encode()),
            (b"content-length", str(len(body)).encode()),
            (b"content-type", b"application/json"),
        ]
        keep_alive = keep_alive and not ends_connection(scope, state.service.draining)  # as the middleware
        headers += identity_headers(request_id, caller[0] if caller else None, close=not keep_alive)
        response = [STATUS_LINE[refused.status]]
        for name, value in headers:
            response += [name, b": ", value, b"\r\n"]
        response += [b"\r\n", body]
        return Refusal(b"".join(response), refused.status, keep_alive, request_id, caller)

    def answered(self, scope: Scope, refusal: Refusal) -> None:
        """The refusal's metrics and access line, once it is written."""
        self._record(scope, refusal.status, refusal.request_id, refusal.caller)

    def answered_invalid(
        self, scope: Scope | None, request_id: str, started: float, status: int = 400, code: str = "invalid_http"
    ) -> None:
        """The metrics and access line of an ``invalid_http`` 400, or of a head refused (408, 431,
        505) (``scope``: the request whose body broke, or whose head was refused; its method and
        path are ``-`` where its request line did not come whole)."""
        method, path = (scope.get("method", "-"), scope.get("path", "-")) if scope is not None else ("-", "-")
        state = {"started": started, "error_code": code}
        self._record({"method": method, "path": path, "state": state}, status, request_id, None)

    def _record(self, scope: Scope, status: int, request_id: str, caller: tuple[str, str] | None) -> None:
        state = self.app.state
        token, caller_token = request_id_var.set(request_id), caller_trace_var.set(caller)
        try:
            finish(state.metrics, scope, status, scope["state"]["started"], state.access_log)
        finally:
            request_id_var.reset(token)
            caller_trace_var.reset(caller_token)


def edge_protocol(app: FastAPI) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, answering ``app``'s refusals itself.

    It hooks the protocol where a parsed request's ASGI task would start, which is not
    uvicorn's public API: a uvicorn without that hook gets the protocol without the edge
    (``ClosingProtocol``, uvicorn's own but for its shutdown), and the middleware refuses as it
    does under any other server.
    """
    if not callable(getattr(HttpToolsProtocol, "_start_asgi_task", None)):
        log.warning("this uvicorn has no hook for the edge: overload is refused by the middleware")
        return ClosingProtocol
    edge = Edge(app)

    class EdgeProtocol(ClosingProtocol):
        # a refusal's ``on_response`` starts the request pipelined behind it, by calling this
        # hook again: one refused after another would recurse as deep as the pipeline, so the
        # hook, called from inside a refusal, leaves the next request to the loop below
        _refusing = False
        _next: tuple[RequestResponseCycle, object] | None = None
        _after_read = False

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: object) -> None:
            if self._refusing:
                self._next = (cycle, app)
                return
            if not self._after_read and (self._closing or draining(edge.app)):
                # whether its answer ends the connection depends on the requests behind it, some
                # perhaps in the read being parsed now: it starts once that read is parsed
                self.loop.call_soon(self._start_after_read, cycle, app)
                return
            while True:
                if self.transport.is_closing() or self._discarding:
                    return  # a request pipelined behind a closing answer is not served (RFC 9112, 9.6)
                scope = cast(Scope, cycle.scope)
                refusal = None
                self._started = cycle  # the request answered next, whoever answers it (``_ends`` asks)
                if app is self.app:  # not uvicorn's own 503 past ``limit_concurrency``
                    try:
                        refusal = edge.refusal(scope, self.server_state.default_headers, cycle.keep_alive)
                    except Exception:  # a bug here must not cost the request its answer: the app gives it
                        path = logged_path(scope["path"])
                        log.exception("the edge failed on %s %s; the app serves it", scope["method"], path)
                if refusal is None:
                    super()._start_asgi_task(cycle, app)
                    return
                cycle.keep_alive = refusal.keep_alive
                cycle.response_started = cycle.response_complete = True  # the body that follows is dropped
                # answered (``_started``): bytes after it that are not HTTP close, not answer it again
                self.transport.write(refusal.response)
                if not cycle.keep_alive:
                    self.close_answered()
                try:
                    edge.answered(scope, refusal)
                except Exception:  # the answer is written: a failure to count it must not stop the next
                    log.exception("counting a refusal failed")
                self._refusing = True
                try:
                    cycle.on_response()  # the next pipelined request, if any, comes back as self._next
                finally:
                    self._refusing = False
                if self._next is None:
                    return
                (cycle, app), self._next = self._next, None

        def _start_after_read(self, cycle: RequestResponseCycle, app: object) -> None:
            self._after_read = True
            try:
                self._start_asgi_task(cycle, app)
            finally:
                self._after_read = False

        def answered_invalid(
            self, scope: Scope | None, request_id: str, started: float, status: int = 400, code: str = "invalid_http"
        ) -> None:
            try:
                edge.answered_invalid(scope, request_id, started, status, code)
            except Exception:  # the answer is written: a failure to count it must not reach the parser
                log.exception("counting an invalid_http answer failed")

    return EdgeProtocol
