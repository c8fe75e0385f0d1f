"""The outermost layer of every request: its id, its clock, the access log, the last resort.

A pure ASGI middleware (no response buffering). It keeps a well-formed ``X-Request-ID``
or makes one, puts it in the logging context and the response header, writes one access
log line, and turns an exception nobody handled into a generic 500 envelope. Routes that
``direct`` claims (the predictions) it serves itself, past the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.access_log import AccessLog, logged_path
from app.api.errors import service_error_response
from app.errors import Draining, RequestTimeout
from app.telemetry.logging import caller_trace_var, request_id_var
from app.telemetry.metrics import Metrics

_error_log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
ARRIVED = "arrived"  # scope["state"] key: perf_counter() when the request's first byte was parsed
# scope["state"] key: set by the HTTP protocol, a callable taking whether the service drains and
# saying whether this answer ends the connection: while it drains, or while the server shuts the
# connection down, unless another request has come (whole or in part) behind this one, which
# would go unanswered
ENDS = "ends_connection"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Request ids need to be unique, not secret: 128 random bits from a seeded PRNG look like a
# uuid4 hex and cost a tenth of one (uuid4 reads the OS entropy pool on every call).
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)  # a forked worker must not repeat its parent's ids


# W3C Trace Context, as OpenTelemetry's propagator reads it when tracing is on: lower-case hex
# only, version ff invalid, and version 00 with nothing after its flags
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?$")


# A body the app reads through its router (the admin API's; a prediction's has the request's
# deadline) must have come this long after the request began, or the request is answered 408.
BODY_TIMEOUT_S = 15.0


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


def receive_within(receive: Receive, deadline: float) -> Receive:
    """``receive``, answered 408 (``RequestTimeout``) if the body has not all come by ``deadline``
    (``perf_counter``); once it has, as it was (a wait for the client to go is not bounded)."""
    whole = False

    async def bounded() -> Message:
        nonlocal whole
        if whole:
            return await receive()
        try:
            async with asyncio.timeout(max(0.0, deadline - time.perf_counter())):
                message = await receive()
        except TimeoutError:
            raise RequestTimeout(f"the request's body did not arrive within {BODY_TIMEOUT_S:g} s") from None
        whole = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return bounded


def caller_trace(scope: Scope) -> tuple[str, str] | None:
    """The trace and parent span ids of a well-formed W3C ``traceparent`` header, if any."""
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            match = _TRACEPARENT.fullmatch(value.decode("latin-1").strip())
            if match is None or match[1] == "ff" or (match[1] == "00" and match[4]):
                return None
            if match[2] == "0" * 32 or match[3] == "0" * 16:
                return None
            return match[2], match[3]
    return None


def request_id_from(scope: Scope) -> str:
    """The client's id if it is well formed, else a fresh one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = str(value.decode("latin-1"))
            if _VALID_ID.fullmatch(candidate):
                return candidate
            break
    return new_request_id()


def new_request_id() -> str:
    """A fresh request id: 128 random bits, from a generator reseeded in a forked worker."""
    return f"{_ids.getrandbits(128):032x}"


def _trace_of(scope: Scope, request_id: str) -> tuple[str | None, contextvars.Token[tuple[str, str] | None] | None]:
    """The request's trace id: its server span's when tracing is on; else the caller's, if it
    sent a ``traceparent`` (set for the logs, with the token that unsets it)."""
    span = trace.get_current_span()  # the HTTP server span, when tracing is on
    context = span.get_span_context()
    trace_id: str | None
    if context.is_valid:
        span.set_attribute("request.id", request_id)
        trace_id, token = format(context.trace_id, "032x"), None
    else:
        caller = caller_trace(scope)
        trace_id, token = (caller[0] if caller else None), caller_trace_var.set(caller)
    scope["state"]["trace_id"] = trace_id  # for an answer the protocol writes itself (a body that breaks)
    return trace_id, token


def draining(app: object) -> bool:
    """``app``'s service is shutting down (False before the service exists, or with no app)."""
    service = getattr(getattr(app, "state", None), "service", None)
    return bool(getattr(service, "draining", False))


def _draining(scope: Scope) -> bool:
    return draining(scope.get("app"))


def ends_connection(scope: Scope, draining: bool) -> bool:
    """Whether this request's answer closes its connection (here, and from the edge): while the
    service drains, each connection ends with its current answer, so that no client sends its
    next request on a connection the server is about to close; unless requests came behind it
    already (pipelined): the last of them ends it. The protocol knows (``ENDS``); under another
    server, every answer while draining ends its connection."""
    ends = scope["state"].get(ENDS)
    return draining if ends is None else bool(ends(draining))


def identity_headers(request_id: str, trace_id: str | None, close: bool) -> list[tuple[bytes, bytes]]:
    """What every answer carries besides its own headers (here, and from the edge): the request
    id, the trace id when there is one, and ``connection: close`` when the connection ends with
    it (past the drain, a reused connection would be cut)."""
    headers = [(b"x-request-id", request_id.encode())]
    if trace_id:
        headers.append((b"x-trace-id", trace_id.encode()))
    if close:
        headers.append((b"connection", b"close"))
    return headers


def finish(metrics: Metrics, scope: Scope, status: int, started: float, access_log: AccessLog | None) -> None:
    """A request's metrics and its access line, once it is answered (here, and by the edge)."""
    seconds = time.perf_counter() - started
    state = scope["state"]
    template = getattr(scope.get("route"), "path", None) or state.get("route") or "unmatched"
    code = state.get("error_code", "ok" if 100 <= status < 400 else "error")
    if status == 0:  # its task ended before anything was sent: cut off at the end of shutdown (or a bug)
        code = "unanswered"
    # what the request counts as, where the app's own answer (or its lack) is not it: the protocol
    # answered it (its body broke), cutting the app off; or its client went and nothing was sent,
    # counted as nginx's 499 client_closed_request (app.api.errors._client_closed)
    if "answered_as" in state:
        status, code = state["answered_as"]
    metrics.request_latency.labels(template, str(status), state.get("lane", "none")).observe(seconds)
    metrics.requests.labels(str(status), code).inc()
    if access_log is not None:
        access_log.line(scope["method"], scope["path"], status, code, seconds, state.get("log_fields", {}))


def _describe_server_span(state: dict[str, Any], status: int) -> None:
    """What a reader of the request's server span (when spans are exported) needs that the HTTP
    attributes do not say: the service's error code of an answer in the envelope (``error.code``;
    for a 5xx ``error.type`` too, as OpenTelemetry's HTTP conventions ask of a server error), and
    for a prediction its lane and the version that served it. A refusal has no child span that
    would say these. Called as the answer starts: the instrumentation ends the span as it is sent."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    code = state.get("answered_as", (status, state.get("error_code")))[1]
    if status >= 400 and code:
        span.set_attribute("error.code", code)
        if status >= 500:
            span.set_attribute("error.type", code)
    if "lane" in state:
        span.set_attribute("lane", state["lane"])
    if (served := state.get("model")) is not None:
        span.set_attributes({"model.name": served.name, "model.version": served.version})


class RequestContextMiddleware:
    """Request id, timing, access log and the 500 of last resort."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        access_log: AccessLog | None = None,
        direct: Callable[[Scope], ASGIApp | None] | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log
        self.direct = direct  # the routes served here, past the router (the predictions)

    def _target(self, scope: Scope, receive: Receive, started: float) -> tuple[ASGIApp, Receive]:
        """What serves the request (a prediction: ``direct``'s; else the router), and how it
        receives: a body read through the router has ``BODY_TIMEOUT_S`` to come."""
        target = self.direct(scope) if self.direct else None
        if target is not None:
            return target, receive
        return self.app, (receive_within(receive, started + BODY_TIMEOUT_S) if _has_body(scope) else receive)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        # the request's clock starts when its first byte arrived, where the HTTP protocol noted it
        # (``ARRIVED``): under load its task starts later, and its deadline runs from the client's send
        started = state.get(ARRIVED) or time.perf_counter()
        request_id = state.get("request_id") or request_id_from(scope)  # the protocol's, if it answered
        state["request_id"] = request_id
        state["started"] = started
        token = request_id_var.set(request_id)
        status = 0
        trace_id, caller_token = _trace_of(scope, request_id)
        self.metrics.in_flight.inc()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                # answered by the protocol (its body broke), what the app, cut off, sends goes
                # nowhere: the server span records the status that was sent
                status = message["status"] = state["answered_as"][0] if "answered_as" in state else message["status"]
                # a 408's body never came whole: what follows it on the connection cannot be told apart
                ends = status == 408 or ends_connection(scope, _draining(scope))
                extra = identity_headers(request_id, trace_id, ends)
                message["headers"] = [*message.get("headers", []), *extra]
                _describe_server_span(state, status)  # the span ends as the answer is sent
            await send(message)

        try:
            target, receive = self._target(scope, receive, started)
            await target(scope, receive, send_with_id)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when its wait after the drain ends (a stalled upload,
            # say): the request gets the 503 the drain promises, not uvicorn's plain-text 500
            if status == 0 and _draining(scope):
                cut = Draining("the service shut down before this request was answered")
                response = await service_error_response(Request(scope), cut)  # the one envelope
                with contextlib.suppress(Exception):  # the connection may be gone too
                    await response(scope, receive, send_with_id)
                # answered: the shutdown that cancelled it is not an error of the app (uvicorn
                # would log a traceback for a client's stalled upload)
                _error_log.info("cut off by the shutdown: answered 503 draining")
                return
            raise
        except Exception as exc:
            _error_log.exception("unhandled error in %s %s", scope["method"], logged_path(scope["path"]))
            server_span = trace.get_current_span()  # it ends outside, with the status only: tell it why
            server_span.record_exception(exc)
            server_span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            if status == 0:
                status = 500
                scope["state"]["error_code"] = "internal_error"
                body = {"code": "internal_error", "message": "internal server error", "request_id": request_id}
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send_with_id({"type": "http.response.body", "body": json.dumps(body).encode()})
        finally:
            self.metrics.in_flight.dec()
            finish(self.metrics, scope, status, started, self.access_log)
            request_id_var.reset(token)
            if caller_token is not None:
                caller_trace_var.reset(caller_token)
