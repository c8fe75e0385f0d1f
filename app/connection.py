"""One HTTP/1.1 connection: uvicorn's httptools protocol, taught to answer at shutdown the
request that had just arrived, to bound a request's head, to refuse an HTTP version other than
1.x (505), and to answer bytes that are not HTTP after the requests before them.

When uvicorn shuts down, it closes every connection that is not in the middle of an
answer, and with it any request that had just arrived: its bytes unread in the socket, or
its headers half parsed. The client sees the connection close with no answer, though it sent
its request before the close. ``ClosingProtocol`` keeps such a connection open until that
request is answered (``503 draining`` by then) with ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import struct
import termios
import time
import urllib.parse
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from app.api.middleware import ARRIVED, ENDS, new_request_id, request_id_from
from app.api.schemas import ErrorResponse

log = logging.getLogger(__name__)

# At shutdown, a connection opened or answered less than QUIET_S ago may have its client's
# next request on the way (a client sends it as soon as it has connected, or, in a loop, as
# soon as it has its answer): it is closed once it has been quiet that long, and a request
# that comes meanwhile is answered first.
QUIET_S = 0.5
# How long a connection closing at shutdown waits for the rest of a request that had begun to
# arrive. One already in the socket is answered at once (503 draining); this bounds a client
# that stops halfway, so that it cannot hold the process's exit.
LAST_REQUEST_S = 2.0
# A request's line and headers: at most this many bytes (431 past it; httptools would buffer
# any amount), arriving within this many seconds of its first byte, or of the connection's
# opening (408, or a quiet close if nothing came): a client trickling a head cannot hold a
# connection, its memory and a task slot open for ever. The body has the request's deadline.
MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 15.0
# A request answered before its body had come (413 on its declared length, a refusal at the edge)
# has the rest of its body read and dropped: it must come within this many seconds of the answer,
# or the connection closes (a client that sent ``Expect: 100-continue`` may never send it, and
# nothing else would bound the wait: the request has its answer, and its deadline no longer runs).
ANSWERED_BODY_S = HEAD_TIMEOUT_S
# A connection that closes after an answer while its request's bytes are still coming (a 413 on
# the declared length with ``Connection: close``, say) is not closed at once: the kernel would
# answer the unread bytes with a reset, and a client still sending would lose the answer (RFC
# 9112, 9.6). Its writing side is shut after the answer, and what still comes is read and
# dropped until the client closes, or nothing has come for LINGER_QUIET_S, or LINGER_S have passed.
LINGER_S = 10.0
LINGER_QUIET_S = 2.0


def _stopped(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel ``timer`` if there is one; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
    return None


def _judge_versions_here(parser: httptools.HttpRequestParser) -> None:
    """Let ``parser`` read a request line of any HTTP version: llhttp takes 0.9, 1.0, 1.1 and
    2.0 and fails any other as bytes that are not HTTP (a 400), where HTTP/1.2 is read as 1.1
    (RFC 9110, 2.5) and HTTP/3.0 is a 505, as HTTP/2.0 is: ``on_headers_complete`` decides."""
    with contextlib.suppress(AttributeError):  # httptools < 0.6.3: 400 for those, as before
        parser.set_dangerous_leniencies(lenient_version=True)


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a request whose head is refused."""


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes that arrived on ``transport``'s socket and have not been read yet (0 if unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        count: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):  # closed under us, or not a socket
        return 0
    return count


class _AnswerTransport:
    """The transport a request's cycle writes its answer to: uvicorn closes it after an answer
    that ends the connection, which here closes as ``ClosingProtocol.close_answered`` says."""

    def __init__(self, transport: asyncio.Transport, protocol: ClosingProtocol) -> None:
        self._transport, self._protocol = transport, protocol
        self.write, self.is_closing = transport.write, transport.is_closing  # each answer's: bound once

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_answered()


class ClosingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, whose shutdown answers the request that had just arrived.

    uvicorn's own closes a connection at once unless an answer is under way, and a request
    sent a moment before dies with it. Here a connection stays open a little longer when its
    next request has begun to arrive (headers partly parsed, or bytes unread in the socket),
    or may be on its way (the connection was opened or answered less than ``QUIET_S`` ago).
    Such a request is read and answered with ``Connection: close``, which closes the
    connection; a connection that stays quiet is closed once ``QUIET_S`` has passed, and one
    whose request stops halfway after ``LAST_REQUEST_S``. A connection quiet for longer, with
    nothing pending, closes at once, as before. It overrides ``shutdown``, which uvicorn calls
    on every connection as it stops, and the parser's callbacks.
    """

    _receiving = False  # between a request's first byte and its end
    _started: RequestResponseCycle | None = None  # the request whose app task started last
    _invalid = False  # bytes that are not HTTP arrived: answered 400 after the requests before them
    _broken: RequestResponseCycle | None = None  # the request whose body broke, if a body did
    _invalid_at = 0.0  # perf_counter when they arrived
    _invalid_answer = (400, "invalid_http", "the request is not valid HTTP/1.1")  # what they get
    _closing = False  # shut down, answering what had begun to arrive before closing
    _bounded = False  # the wait is already LAST_REQUEST_S, the most a request gets
    _active_at = float("-inf")  # the loop's clock when the connection was opened or last answered
    _linger: asyncio.TimerHandle | None = None
    _completed: RequestResponseCycle | None = None  # the last request whose bytes all arrived
    _in_head = False  # between a request's first byte and the end of its headers
    _head_bytes = 0  # bytes received while in a head (short by at most the read it began in)
    _head_size = 0  # the head's own bytes, as parsed
    _head_began = False  # a head began in the read being parsed: its own bytes of that read count
    _head_id: str | None = None  # the client's X-Request-ID in a head refused before it was whole
    _head_refused = False  # the answer ``_stop_reading`` gives is to a request whose head was refused
    _line_whole = False  # the head's request line has arrived whole (a CRLF of the head came)
    _line_ended = False  # the last read of the head ended a line (with CRLF)
    _ended_in_read = False  # a request's bytes ended in the read being parsed
    _head_timer: asyncio.TimerHandle | None = None
    _upgrade_body_left = 0  # body bytes still due to a request whose Upgrade header is ignored
    _body_timer: asyncio.TimerHandle | None = None  # bounds the body of a request answered before it came
    _discarding = False  # answered and shut for writing: what still comes is dropped (``close_answered``)
    _linger_ends = 0.0  # the loop's clock when a connection discarding closes whatever comes
    _answer_transport: _AnswerTransport | None = None

    def shutdown(self) -> None:
        answering = self.cycle is not None and not self.cycle.response_complete
        if answering and not self._followed():
            super().shutdown()  # an answer is under way: it closes the connection when sent
            return
        pending = answering or self._receiving or unread_bytes(self.transport) > 0
        quiet_for = self.loop.time() - self._active_at
        if not pending and quiet_for >= QUIET_S:
            super().shutdown()  # nothing pending: closed now
            return
        self._closing = True
        if self.cycle is not None and not self._behind_last():
            self.cycle.keep_alive = False  # the last request parsed closes it (else the one behind it)
        self._bounded = pending
        self._linger = self.loop.call_later(LAST_REQUEST_S if pending else QUIET_S - quiet_for, self._linger_done)

    def _linger_done(self) -> None:
        self._linger = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # an answer is under way: it closes the connection when sent
        if self._receiving and not self._bounded:  # a request began while the connection was quiet
            self._bounded = True
            self._linger = self.loop.call_later(LAST_REQUEST_S, self._linger_done)
            return
        self.transport.close()

    def close_answered(self) -> None:
        """Close the connection after an answer that ends it: at once, unless bytes of a request
        are still coming (its body, answered before it came, or unread in the socket). Then the
        answer goes out followed by the end of the stream, and the connection reads and drops what
        comes until the client closes, or nothing came for ``LINGER_QUIET_S``, or ``LINGER_S``
        passed: closed with those bytes unread, the kernel would reset it, and the client might
        never read the answer."""
        transport = self.transport
        if transport.is_closing() or self._discarding:
            return
        if not (self._receiving or unread_bytes(transport) > 0) or not transport.can_write_eof():
            transport.close()
            return
        self._discarding = True
        self._body_timer = _stopped(self._body_timer)
        self._head_timer = _stopped(self._head_timer)
        transport.write_eof()  # after what is buffered: the answer, whole
        self.flow.resume_reading()  # paused while the app did not read the body: it is drained now
        transport.resume_reading()  # (or by a refused head, which paused the transport itself)
        self._linger_ends = self.loop.time() + LINGER_S
        self._linger_quietly()

    def _linger_quietly(self) -> None:
        """(Re)arm the close of a connection discarding: ``LINGER_QUIET_S`` from now, at most at
        ``_linger_ends``."""
        self._linger = _stopped(self._linger)
        closes = min(self.loop.time() + LINGER_QUIET_S, self._linger_ends)
        self._linger = self.loop.call_at(closes, self.transport.close)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._answer_transport = _AnswerTransport(transport, self)
        self._active_at = self.loop.time()
        _judge_versions_here(self.parser)
        self._arm_head_timer()  # its first request's head, too, has HEAD_TIMEOUT_S to come

    def on_message_begin(self) -> None:
        if self._discarding:  # pipelined behind the answer that ended the connection: not served
            raise _HeadRefused  # (RFC 9112, 9.6) and the rest of this read not parsed
        super().on_message_begin()
        self.scope["state"][ARRIVED] = time.perf_counter()  # the request's clock (and deadline) start here
        self.scope["state"][ENDS] = functools.partial(self._ends, self.scope)
        self._receiving = True
        self._in_head, self._head_bytes, self._head_size, self._head_began = True, 0, 0, True
        self._line_whole = self._line_ended = False
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_timer = _stopped(self._head_timer)
        if self._head_size > MAX_HEAD_BYTES:  # a head that came whole, in one read
            self._refuse_head(
                431, "headers_too_large", f"the request's line and headers are over {MAX_HEAD_BYTES} bytes"
            )
            raise _HeadRefused  # the parser stops here: its body is not read as anything
        version = self.parser.get_http_version()
        if not version.startswith("1."):  # HTTP/2.0 sent as text, 0.9, 3.0: not served as 1.1 (RFC 9110, 15.6.6)
            self._refuse_version(version)
            raise _HeadRefused
        if version != "1.0" and sum(name == b"host" for name, _ in self.headers) != 1:
            # RFC 9112, 3.2: a 400 (two Hosts give a proxy and this server two views of one request)
            self._refuse_head(400, "invalid_http", "an HTTP/1.1 request must have exactly one Host header")
            raise _HeadRefused
        super().on_headers_complete()
        if version not in {"1.0", "1.1"}:  # 1.2 and up: read as 1.1, the highest 1.x served (RFC 9110, 2.5)
            self.scope["http_version"] = "1.1"
        if self.cycle is not None and self._answer_transport is not None:
            self.cycle.transport = cast(asyncio.Transport, self._answer_transport)
        # closing: whether its answer says Connection: close is decided as that answer starts
        # (``_ends``), once what came behind it in the same read has been parsed too

    def on_message_complete(self) -> None:
        self._completed = self.cycle  # (uvicorn's returns early for a request answered already)
        self._ended_in_read = True
        self._body_timer = _stopped(self._body_timer)
        super().on_message_complete()
        self._receiving = False
        self._close_if_answered()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection: the body of a request answered already did not come")
            self.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_timer = _stopped(self._head_timer)
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _head_timed_out(self) -> None:
        # armed at the connection's opening and at each request's first byte, cancelled at the end
        # of its headers: so either a head is under way, or nothing has come since the connection opened
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head:
            self._refuse_head(
                408, "request_timeout", f"the request's headers did not arrive within {HEAD_TIMEOUT_S:g} s"
            )
        elif not self._unanswered():  # connected, and no request began: closed as an idle keep-alive is
            self.transport.close()

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

    def on_response_complete(self) -> None:
        if self._discarding:  # the connection ends with this answer: nothing behind it runs
            self.server_state.total_requests += 1  # (as uvicorn's own counts it)
            return
        self._active_at = self.loop.time()
        cycle = self.cycle
        # answered, its body still due (an ignored Upgrade's body arrives outside the parser)
        body_due = (self._receiving and self._completed is not cycle) or self._upgrade_body_left
        if cycle is not None and cycle.response_complete and body_due and self._body_timer is None:
            self._body_timer = self.loop.call_later(ANSWERED_BODY_S, self._body_timed_out)
        super().on_response_complete()  # starts the next pipelined request, if any
        if self._invalid and not self._unanswered():
            self._answer_invalid()
            self.close_answered()
            return
        self._close_if_answered()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: object) -> None:
        self._started = cycle
        super()._start_asgi_task(cycle, app)  # type: ignore[arg-type]

    def _ends(self, scope: object, draining: bool) -> bool:
        """Whether the answer written now to the request of ``scope`` ends the connection: while
        the service drains or this connection is shut down, unless a request came behind it (the
        last such one ends it); and an answer to a request whose client still waits for ``100
        Continue`` to send its body: it may send it or not (RFC 9110, 10.1.1), and what follows
        could not be told apart from the next request."""
        answered = next((c for c in (self._started, self.cycle) if c is not None and c.scope is scope), None)
        if answered is not None and answered.waiting_for_100_continue and self._completed is not answered:
            return True
        return (draining or self._closing) and not self._followed()

    def _followed(self) -> bool:
        """Another request came behind the one answered now: parsed and waiting (pipelined), or
        arriving, or unread in the socket."""
        return bool(self.pipeline) or self._behind_last()

    def _behind_last(self) -> bool:
        """A request behind the last one parsed whole: its head arriving, or bytes unread."""
        if self._receiving and self.cycle is not None and self._completed is self.cycle:
            return True
        return not self.transport.is_closing() and unread_bytes(self.transport) > 0

    def _unanswered(self) -> bool:
        """A request on this connection is running, or waits behind one (pipelined)."""
        return bool(self.pipeline) or (self._started is not None and not self._started.response_complete)

    def data_received(self, data: bytes) -> None:
        if self._discarding:  # the rest of a request after the answer that ended the connection
            self._linger_quietly()
            return
        if self._invalid:
            return  # past bytes that are not HTTP, nothing more is read as a request
        if self._upgrade_body_left:
            data = self._upgrade_body(data)
            if not data:
                return
        self._head_began = self._ended_in_read = False
        try:
            self._unset_keepalive_if_required()
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._ignore_upgrade(data[exc.args[0] :])  # what follows is read, and counted, there
            return
        except httptools.HttpParserError:
            if self._invalid or self._discarding:  # refused already (a head too large), or closing
                return
            if self._in_head and self.parser.get_method() == b"PRI" and self.parser.get_http_version() == "2.0":
                # HTTP/2's connection preface (``curl --http2-prior-knowledge``), where llhttp stops
                self._line_whole = True
                self._refuse_version("2.0")
                return
            # uvicorn's warning, but at DEBUG: any client can send bytes that are not HTTP, and the
            # access line (code invalid_http, the id the client was given) already says it
            self.logger.debug("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        if self._in_head and not self._invalid:
            # a head that began in this read counts its own bytes of it, not the request's body
            # before it (pipelined); one that goes on from an earlier read, the whole read: a head
            # line not yet whole is not parsed, and a bound of one read over is what that costs
            self._head_bytes += self._head_size if self._head_began else len(data)
            # a line of the head ended: its request line is whole (this read's bytes are all the
            # head's, but for the CRLFs between requests, unless a request ended in it before)
            self._line_ended = data.endswith(b"\r\n")
            whole = self._line_ended or (not self._ended_in_read and b"\n" in data.lstrip(b"\r\n"))
            self._line_whole = self._line_whole or whole
            if self._head_bytes > MAX_HEAD_BYTES:
                message = f"the request's line and headers are over {MAX_HEAD_BYTES} bytes"
                self._refuse_head(431, "headers_too_large", message)

    def _ignore_upgrade(self, rest: bytes) -> None:
        """An ``Upgrade`` other than to a WebSocket (``h2c``, which ``curl --http2`` asks for over
        plain http) is ignored, as RFC 9110 (7.8) allows: httptools ends the request at its headers,
        with no body, and would read no more; here the body (its Content-Length) is given to the
        request and a fresh parser reads what follows. A chunked body cannot be told from what
        follows it: such a request is answered 400 and the connection closes."""
        cycle = self.cycle
        headers = dict(cycle.scope["headers"]) if cycle is not None else {}
        length = headers.get(b"content-length", b"0")
        if cycle is None or b"transfer-encoding" in headers or not length.isdigit():
            # the request itself is what breaks: the 400 is its own answer (httptools ended it
            # at its headers, and its app task, started, would answer it too)
            self._stop_reading(cycle)
            return
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3, as uvicorn does
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        _judge_versions_here(self.parser)
        self._upgrade_body_left = int(length)
        if self._upgrade_body_left and not cycle.response_complete:
            cycle.more_body = True  # httptools said the request ended at its headers: it has not
        rest = self._upgrade_body(rest)
        if rest:
            self.data_received(rest)

    def _upgrade_body(self, data: bytes) -> bytes:
        """The body bytes due to a request whose Upgrade is ignored go to it; returns the rest."""
        take, data = data[: self._upgrade_body_left], data[self._upgrade_body_left :]
        self._upgrade_body_left -= len(take)
        if not self._upgrade_body_left:
            self._body_timer = _stopped(self._body_timer)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.body += take
            if not self._upgrade_body_left:
                cycle.more_body = False
            cycle.message_event.set()
        return data

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

    def _close_if_answered(self) -> None:
        # answered before its body had all arrived (a refusal at the edge): closed once it has;
        # a request sent behind it is read and answered first
        answered = self.cycle is None or self.cycle.response_complete
        if self._closing and not self._receiving and answered and not self._behind_last():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._linger = _stopped(self._linger)
        self._head_timer = _stopped(self._head_timer)
        self._body_timer = _stopped(self._body_timer)
        # uvicorn tells only the last request parsed; the one running (pipelined requests were
        # read behind it) must see its client go too, and leave the queue uncomputed
        running = self._started
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True
            running.message_event.set()
        # those read whole and waiting behind it never run: each is a 499 all the same, counted here
        for cycle, _ in self.pipeline:
            scope = cast("dict[str, Any]", cycle.scope)
            state = scope["state"]
            self.answered_invalid(scope, request_id_from(scope), state[ARRIVED], 499, "client_closed_request")
        self.pipeline.clear()
        super().connection_lost(exc)
