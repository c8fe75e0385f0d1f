"""A small HTTP/1.1 client for the load generator, cheap enough not to eat the cores it measures.

The load generator shares the machine with the service it measures; a general client
(httpx builds a request object, headers and a response model per call) costs several
times more CPU per request than this one, and that CPU comes out of the service's share.
Here a request is bytes built once (keep-alive, ``Content-Length``) and written as is; a
response is its status line, its headers and a body delimited by ``Content-Length``,
chunked transfer coding, or the connection's end. Anything else fails loudly.

A request is never sent twice: a server that closes the connection after the request was
written may have read it (and run it), so that is an error (``ConnectionClosed``), not a retry.
Only a kept-alive connection found closed before the write is replaced, and that is counted;
and one idle for ``IDLE_REUSE_S`` is not reused at all, as browsers and httpx do: a request
written just as the server's idle timeout closes it is reset, whatever the client checked first.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Mapping
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024
# under uvicorn's keep-alive timeout (5 s): at twice the load an open-loop run's spare connections sit
# idle that long, and one reused as the server closed it was reset after the write (a failed request)
IDLE_REUSE_S = 4.0


class HttpProtocolError(Exception):
    """The server sent something this client does not understand."""


class ConnectionClosed(ConnectionError):
    """The server closed the connection after the request was written, before a byte of its
    answer: it may have read the request, so it is a failed request and is not sent again."""


@dataclass(frozen=True)
class ResponseHead:
    """A parsed status line and headers (names lower-cased; a repeated header keeps its last value)."""

    status: int
    headers: dict[str, str]
    content_length: int | None
    chunked: bool
    keep_alive: bool


def build_request(method: str, host: str, path: str, headers: Mapping[str, str], body: bytes = b"") -> bytes:
    """One HTTP/1.1 request as bytes, keep-alive, with ``Host`` and ``Content-Length``."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_head(head: bytes) -> ResponseHead:
    """The status line and headers of ``head`` (everything up to and including the blank line)."""
    text = head.decode("latin-1").rstrip("\r\n")
    status_line, *lines = text.split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _digits(parts[1]) or len(parts[1]) != 3:
        raise HttpProtocolError(f"bad status line {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpProtocolError(f"bad header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    status = int(parts[1])
    encoding = headers.get("transfer-encoding", "").lower()
    codings = [c.strip() for c in encoding.split(",") if c.strip()]
    if codings and codings != ["chunked"]:
        raise HttpProtocolError(f"unsupported Transfer-Encoding {encoding!r}")
    chunked = codings == ["chunked"]
    length: int | None = None
    if not chunked and "content-length" in headers:
        value = headers["content-length"]
        if not _digits(value):
            raise HttpProtocolError(f"bad Content-Length {value!r}")
        length = int(value)
    if status in (204, 304) or 100 <= status < 200:
        length = 0
    connection = headers.get("connection", "").lower()
    keep_alive = parts[0] == "HTTP/1.1" and "close" not in connection
    if length is None and not chunked:
        keep_alive = False  # the body runs to the end of the connection
    return ResponseHead(status, headers, length, chunked, keep_alive)


def _digits(text: str) -> bool:
    """ASCII decimal digits only (``str.isdigit`` also takes "²" and other digits ``int`` refuses)."""
    return text.isascii() and text.isdigit()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size_text = size_line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError as exc:
            raise HttpProtocolError(f"bad chunk size {size_text[:20]!r}") from exc
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, ignored
                pass
            return bytes(body)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise HttpProtocolError("chunk not followed by CRLF")


async def read_response(reader: asyncio.StreamReader) -> tuple[ResponseHead, bytes]:
    """One response from ``reader``: its head and its whole body."""
    try:
        head = parse_head(await reader.readuntil(b"\r\n\r\n"))
    except asyncio.LimitOverrunError as exc:
        raise HttpProtocolError(f"response head longer than {MAX_HEAD_BYTES} bytes") from exc
    except asyncio.IncompleteReadError as exc:
        if exc.partial:  # part of an answer, then the end: a broken answer, not a closed connection
            raise
        raise ConnectionClosed("the server closed the connection without answering") from None
    if head.chunked:
        try:
            body = await _read_chunked(reader)
        except asyncio.LimitOverrunError as exc:  # a chunk's size or trailer line past the reader's limit
            raise HttpProtocolError("a chunk line past the reader's limit") from exc
    elif head.content_length is not None:
        body = await reader.readexactly(head.content_length)
    else:
        body = await reader.read()
    return head, body


class Connection:
    """One keep-alive connection, reopened when the server closes it. One request at a time."""

    def __init__(self, host: str, port: int, idle_reuse_s: float = IDLE_REUSE_S) -> None:
        self.host, self.port, self.idle_reuse_s = host, port, idle_reuse_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._idle_since = 0.0
        self.opened = 0
        self.retried = 0  # requests that found this connection closed before their write, and reopened it

    async def request(self, data: bytes) -> tuple[ResponseHead, bytes]:
        """Send ``data`` (a whole request) and read the response.

        On any error the connection is closed (the next request reopens it) and the error raised.
        A kept-alive connection that the server closed while it sat idle (an idle timeout) is
        known by its end of stream, received (or waiting in the socket) before anything is written: the request
        then goes on a fresh connection (counted in ``retried``), since it was never sent. An end
        of stream that comes after the write is not retried: the server may have read the request.
        A check for that end that fails itself closes the connection too (not counted): lent again,
        it would fail the same way every time.
        """
        try:
            closed = self._closed_while_idle()
        except Exception:  # the check itself failed: nothing is written yet, so a fresh connection is safe
            self.close()
            closed = False  # not counted in retried: nobody saw the server close it
        if closed:
            self.close()
            self.retried += 1
        elif time.monotonic() - self._idle_since >= self.idle_reuse_s:
            self.close()  # (a fresh one, never used, too: closing nothing)
        if self._writer is None or self._reader is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEAD_BYTES)
            self.opened += 1
        try:
            self._writer.write(data)
            head, body = await read_response(self._reader)
        except BaseException:
            self.close()
            raise
        if not head.keep_alive:
            self.close()
        self._idle_since = time.monotonic()
        return head, body

    def _closed_while_idle(self) -> bool:
        """Whether the server ended (or reset) this open connection between requests. The
        event loop reads a connection's end of stream as it arrives, whether or not anyone
        waits on it, so one that came while the connection sat in the pool is seen here; the
        socket is polled (without waiting: about a microsecond) for one that came just now.

        ``poll``, not ``select``: ``select`` takes no descriptor from 1024 up (``ValueError``), and a
        client with a thousand connections open has them; every reuse of those failed, unsent."""
        if self._reader is None or self._writer is None:
            return False
        if self._reader.at_eof() or self._reader.exception() is not None or self._writer.is_closing():
            return True
        # one that came in the same loop turn as the last answer is in the socket, not read yet: a
        # server that answers and closes at once (keep-alive promised) would fail every other request
        sock = self._writer.get_extra_info("socket")
        return sock is not None and _readable(sock.fileno())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


def _readable(fd: int) -> bool:
    """Whether ``fd`` has something to read, or has ended or failed (``POLLHUP``, ``POLLERR`` and
    ``POLLNVAL`` are reported unasked), right now. Between requests nothing is due, so it is a close."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


class Pool:
    """Connections to one server, each lent to one request at a time; grows on demand."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[Connection] = []
        self._every: list[Connection] = []

    @property
    def size(self) -> int:
        """Connections opened side by side at most: one per request in flight."""
        return len(self._every)

    @property
    def retried(self) -> int:
        """Requests that found their kept-alive connection closed by the server before their
        write and went on a fresh one instead (never a request the server may have read)."""
        return sum(connection.retried for connection in self._every)

    async def request(self, data: bytes) -> tuple[ResponseHead, bytes]:
        if self._idle:
            connection = self._idle.pop()
        else:
            connection = Connection(self.host, self.port)
            self._every.append(connection)
        try:
            return await connection.request(data)
        finally:
            self._idle.append(connection)

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
