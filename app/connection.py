"""One HTTP/1.1 connection: uvicorn's httptools protocol, taught to answer at shutdown the
request that had just arrived, to bound a request's head, to refuse an HTTP version other than
1.x (505), and to answer bytes that are not HTTP after the requests before them.
The answers it gives itself to what it refuses to read (400 ``invalid_http``, 408, 431, 505)
are in ``app.refused_heads``; its close after an answer that ends the connection (the lingering
close, the transport an answer is written to) in ``app.lingering_close``.

When uvicorn shuts down, it closes every connection that is not in the middle of an
answer, and with it any request that had just arrived: its bytes unread in the socket, or
its headers half parsed. The client sees the connection close with no answer, though it sent
its request before the close. ``ClosingProtocol`` keeps such a connection open until that
request is answered (``503 draining`` by then) with ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from app.api.middleware import ARRIVED, ENDS, request_id_from
from app.lingering_close import AnswerTransport, stopped, unread_bytes
from app.refused_heads import RefusingProtocol

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


def _judge_versions_here(parser: httptools.HttpRequestParser) -> None:
    """Let ``parser`` read a request line of any HTTP version: llhttp takes 0.9, 1.0, 1.1 and
    2.0 and fails any other as bytes that are not HTTP (a 400), where HTTP/1.2 is read as 1.1
    (RFC 9110, 2.5) and HTTP/3.0 is a 505, as HTTP/2.0 is: ``on_headers_complete`` decides."""
    with contextlib.suppress(AttributeError):  # httptools < 0.6.3: 400 for those, as before
        parser.set_dangerous_leniencies(lenient_version=True)


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a request whose head is refused."""


class ClosingProtocol(RefusingProtocol):
    """uvicorn's httptools protocol, whose shutdown answers the request that had just arrived.

    uvicorn's own closes a connection at once unless an answer is under way, and a request
    sent a moment before dies with it. Here a connection stays open a little longer when its
    next request has begun to arrive (headers partly parsed, or bytes unread in the socket),
    or may be on its way (the connection was opened or answered less than ``QUIET_S`` ago).
    Such a request is read and answered with ``Connection: close``, which closes the
    connection; a connection that stays quiet is closed once ``QUIET_S`` has passed, and one
    whose request stops halfway after ``LAST_REQUEST_S``. A connection quiet for longer, with
    nothing pending, closes at once, as before. It overrides ``shutdown``, which uvicorn calls
    on every connection as it stops, and the parser's callbacks; what it refuses is answered as
    its base ``RefusingProtocol`` says, and an answer that ends the connection closes it as
    ``LingeringProtocol.close_answered`` does.
    """

    _closing = False  # shut down, answering what had begun to arrive before closing
    _bounded = False  # the wait is already LAST_REQUEST_S, the most a request gets
    _active_at = float("-inf")  # the loop's clock when the connection was opened or last answered
    _head_bytes = 0  # bytes received while in a head (short by at most the read it began in)
    _head_size = 0  # the head's own bytes, as parsed
    _head_began = False  # a head began in the read being parsed: its own bytes of that read count
    _ended_in_read = False  # a request's bytes ended in the read being parsed
    _upgrade_body_left = 0  # body bytes still due to a request whose Upgrade header is ignored
    _answer_transport: AnswerTransport | None = None

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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._answer_transport = AnswerTransport(transport, self)
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
        self._head_timer = stopped(self._head_timer)
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
        self._body_timer = stopped(self._body_timer)
        super().on_message_complete()
        self._receiving = False
        self._close_if_answered()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection: the body of a request answered already did not come")
            self.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_timer = stopped(self._head_timer)
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
            self._body_timer = stopped(self._body_timer)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.body += take
            if not self._upgrade_body_left:
                cycle.more_body = False
            cycle.message_event.set()
        return data

    def _close_if_answered(self) -> None:
        # answered before its body had all arrived (a refusal at the edge): closed once it has;
        # a request sent behind it is read and answered first
        answered = self.cycle is None or self.cycle.response_complete
        if self._closing and not self._receiving and answered and not self._behind_last():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._linger = stopped(self._linger)
        self._head_timer = stopped(self._head_timer)
        self._body_timer = stopped(self._body_timer)
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
