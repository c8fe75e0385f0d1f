"""The lingering close of an HTTP connection whose answer ends it, and the transport a request's
answer is written to.

A connection that closes after an answer while its request's bytes are still coming (a 413 on
the declared length with ``Connection: close``, a refused head) is not closed at once: the kernel
would answer the unread bytes with a reset, and a client still sending would lose the answer (RFC
9112, 9.6). Its writing side is shut after the answer, and what still comes is read and dropped
until the client closes, or nothing has come for ``LINGER_QUIET_S``, or ``LINGER_S`` have passed.
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

LINGER_S = 10.0
LINGER_QUIET_S = 2.0


def stopped(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel ``timer`` if there is one; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
    return None


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


class AnswerTransport:
    """The transport a request's cycle writes its answer to: uvicorn closes it after an answer
    that ends the connection, which here closes as ``LingeringProtocol.close_answered`` says."""

    def __init__(self, transport: asyncio.Transport, protocol: LingeringProtocol) -> None:
        self._transport, self._protocol = transport, protocol
        self.write, self.is_closing = transport.write, transport.is_closing  # each answer's: bound once

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_answered()


class LingeringProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing after an answer that ends the connection as
    ``close_answered`` says; ``ClosingProtocol`` (``app.connection``) keeps the state it reads
    (a request arriving, the timers that bound its head and body) up to date."""

    _receiving = False  # between a request's first byte and its end
    _linger: asyncio.TimerHandle | None = None
    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None  # bounds the body of a request answered before it came
    _discarding = False  # answered and shut for writing: what still comes is dropped (``close_answered``)
    _linger_ends = 0.0  # the loop's clock when a connection discarding closes whatever comes

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
        self._body_timer = stopped(self._body_timer)
        self._head_timer = stopped(self._head_timer)
        transport.write_eof()  # after what is buffered: the answer, whole
        self.flow.resume_reading()  # paused while the app did not read the body: it is drained now
        transport.resume_reading()  # (or by a refused head, which paused the transport itself)
        self._linger_ends = self.loop.time() + LINGER_S
        self._linger_quietly()

    def _linger_quietly(self) -> None:
        """(Re)arm the close of a connection discarding: ``LINGER_QUIET_S`` from now, at most at
        ``_linger_ends``."""
        self._linger = stopped(self._linger)
        closes = min(self.loop.time() + LINGER_QUIET_S, self._linger_ends)
        self._linger = self.loop.call_at(closes, self.transport.close)
