"""Connections closed at shutdown: a request that had just arrived is answered, not dropped.

The real uvicorn server on a loopback port with the protocol ``ai-backend serve`` uses. Each
test calls ``shutdown`` on the server's connections as uvicorn does when it stops, at a
moment the test chooses: with a request's bytes unread in the socket, halfway through a
request's headers, just after an answer, or with nothing pending.
"""

from __future__ import annotations

import asyncio
import errno
import select
import socket
import time
from collections.abc import Callable
from typing import cast

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app import connection as connection_module
from app import listeners
from app.batching import Lane
from app.bench.rawhttp import read_response
from app.connection import unread_bytes
from app.listeners import close_listeners
from tests.conftest import SettingsFactory
from tests.integration.test_edge import Served, predict, served

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def kept_alive(running: Served) -> Stream:
    """A connection that has had one prediction answered and stays open."""
    reader, writer = await running.connect()
    writer.write(predict())
    head, _ = await read_response(reader)
    assert head.status == 200 and head.keep_alive
    return reader, writer


def accepted(running: Served, stream: Stream | tuple[None, socket.socket]) -> HttpToolsProtocol | None:
    """The server's protocol for the client's connection ``stream``, once the server has accepted it."""
    client = stream[1]
    port = client.getsockname()[1] if isinstance(client, socket.socket) else client.get_extra_info("sockname")[1]
    assert running.server is not None
    found = [c for c in running.server.server_state.connections if c.client and c.client[1] == port]
    assert len(found) <= 1 and all(isinstance(c, HttpToolsProtocol) for c in found)
    return cast(HttpToolsProtocol, found[0]) if found else None


def server_side(running: Served, stream: Stream) -> HttpToolsProtocol:
    """The server's protocol for the client's connection ``stream``, which it has served."""
    protocol = accepted(running, stream)
    assert protocol is not None
    return protocol


def arrived_unread(protocol: HttpToolsProtocol) -> None:
    """Until the request just written sits in the server's socket. It does not yield to the
    event loop, so the server cannot read it meanwhile."""
    deadline = time.monotonic() + 5
    while not unread_bytes(protocol.transport):
        assert time.monotonic() < deadline, "the request never reached the server's socket"
        time.sleep(0.001)


async def read_by_server(protocol: HttpToolsProtocol) -> None:
    """Until the server has read everything sent so far."""
    async with asyncio.timeout(5):
        while unread_bytes(protocol.transport):  # noqa: ASYNC110 (the socket has no event for it)
            await asyncio.sleep(0.001)


async def half_sent(running: Served) -> tuple[Stream, bytes]:
    """A kept-alive connection on which part of a prediction's request line and headers has
    been sent and read by the server; and the rest of that request."""
    stream = await kept_alive(running)
    request = predict()
    stream[1].write(request[:40])
    await read_by_server(server_side(running, stream))
    return stream, request[40:]


def shut_down(running: Served) -> None:
    """What uvicorn does to its connections when it stops (after closing its listeners)."""
    assert running.server is not None
    for connection in list(running.server.server_state.connections):
        connection.shutdown()


async def closed(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(10):
        return await reader.read() == b""


async def refused_draining_then_closed(stream: Stream, request: bytes | None = None) -> None:
    """Send ``request`` (a prediction by default) on ``stream``: it is answered 503 ``draining``
    with ``Connection: close``, and the server closes the connection after it."""
    reader, writer = stream
    writer.write(predict() if request is None else request)
    head, body = await read_response(reader)
    assert head.status == 503 and b'"code":"draining"' in body and head.headers["connection"] == "close"
    assert await closed(reader)
    writer.close()


@pytest.fixture
def quiet_s(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Sets how long a connection answered a moment ago is kept open at shutdown."""
    return lambda seconds: monkeypatch.setattr(connection_module, "QUIET_S", seconds)


async def test_a_request_unread_when_shutdown_begins_is_answered_then_the_connection_closes(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    quiet_s(0.0)  # only what already arrived keeps a connection open
    async with served(make_settings()) as running:
        pending, idle = await kept_alive(running), await kept_alive(running)
        await running.service.drain(1.0)
        pending[1].write(predict(X_Request_ID="sent-before-the-close"))
        arrived_unread(server_side(running, pending))
        idle_protocol = server_side(running, idle)
        shut_down(running)
        assert idle_protocol.transport.is_closing(), "a connection with nothing pending closes at once"
        head, body = await read_response(pending[0])
        assert head.status == 503 and b'"code":"draining"' in body
        assert head.headers["x-request-id"] == "sent-before-the-close"
        assert head.headers["connection"] == "close" and int(head.headers["retry-after"]) >= 1
        assert await closed(pending[0])
        assert await closed(idle[0])
        for _, writer in (pending, idle):
            writer.close()


async def test_a_request_sent_just_after_an_answer_is_answered_though_shutdown_came_first(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    """A client in a loop sends its next request the moment it has its answer; shutdown may
    reach the connection before that request does."""
    quiet_s(60.0)
    async with served(make_settings()) as running:
        reader, writer = await kept_alive(running)
        await running.service.drain(1.0)
        protocol = server_side(running, (reader, writer))
        shut_down(running)
        assert not protocol.transport.is_closing(), "answered a moment ago: kept open for the next request"
        await refused_draining_then_closed((reader, writer))


async def test_a_connection_opened_just_before_shutdown_gets_its_first_request_answered(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    quiet_s(60.0)
    async with served(make_settings()) as running:
        await running.service.drain(1.0)
        stream = await running.connect()
        async with asyncio.timeout(5):
            while not (protocol := accepted(running, stream)):  # noqa: ASYNC110 (uvicorn has no event for it)
                await asyncio.sleep(0.001)
        shut_down(running)
        assert not protocol.transport.is_closing(), "opened a moment ago: kept open for its first request"
        await refused_draining_then_closed(stream)


async def test_a_connection_waiting_in_the_listeners_backlog_is_taken_and_answered_before_the_listener_closes(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    """uvicorn's shutdown closes its listeners, which resets the connections the kernel had
    completed and the server had not accepted yet; ``ai-backend serve`` takes them first."""
    quiet_s(60.0)
    async with served(make_settings()) as running:
        assert running.server is not None
        await running.service.drain(1.0)
        client = socket.create_connection(("127.0.0.1", running.port))  # completed by the kernel alone
        try:
            assert accepted(running, (None, client)) is None, "the server has not run since: not accepted yet"
            assert await close_listeners(running.server) == 1
            assert not any(listening.is_serving() for listening in running.server.servers)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", running.port)).close()
            shut_down(running)
            client.setblocking(False)
            stream = await asyncio.open_connection(sock=client)
        except BaseException:
            client.close()
            raise
        await refused_draining_then_closed(stream)


async def test_a_connection_answered_a_moment_ago_that_stays_quiet_is_closed(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    quiet_s(0.05)
    async with served(make_settings()) as running:
        reader, writer = await kept_alive(running)
        shut_down(running)
        assert await closed(reader)
        writer.close()


async def test_without_a_drain_the_request_is_served_and_the_answer_closes_the_connection(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    """SIGINT, or a start-up failure, shuts uvicorn down with no drain: the request is computed."""
    quiet_s(0.0)
    async with served(make_settings()) as running:
        reader, writer = await kept_alive(running)
        writer.write(predict())
        arrived_unread(server_side(running, (reader, writer)))
        shut_down(running)
        head, _ = await read_response(reader)
        assert head.status == 200 and head.headers["connection"] == "close"
        assert await closed(reader)
        writer.close()


async def test_a_request_half_received_when_shutdown_begins_is_answered(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    quiet_s(0.0)
    async with served(make_settings()) as running:
        stream, rest = await half_sent(running)
        await running.service.drain(1.0)
        shut_down(running)
        await refused_draining_then_closed(stream, rest)


async def test_a_request_whose_rest_never_comes_is_closed_after_a_bound(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, quiet_s: Callable[[float], None]
) -> None:
    quiet_s(0.0)
    monkeypatch.setattr(connection_module, "LAST_REQUEST_S", 0.05)
    async with served(make_settings()) as running:
        (reader, writer), _ = await half_sent(running)
        shut_down(running)
        assert await closed(reader), "closed without an answer once the bound passed"
        writer.close()


async def _refused_after_shutdown(running: Served, tracing: bool) -> tuple[object, bool]:
    stream = await kept_alive(running)  # answered a moment ago: kept open (QUIET_S) at shutdown
    running.app.state.tracing = tracing  # True: the edge stands aside and the app answers
    shut_down(running)
    reader, writer = stream
    writer.write(predict(X_Request_Timeout="1"))
    head, _ = await asyncio.wait_for(read_response(reader), 10)
    is_closed = await closed(reader)
    writer.close()
    return head, is_closed


async def test_an_edge_refusal_after_shutdown_began_says_connection_close(make_settings: SettingsFactory) -> None:
    # a shutdown without the drain (the service still ready: SIGINT, a second SIGTERM), and a
    # request the edge refuses by prediction: its 503 must say close, as the app's does
    async with served(make_settings()) as running:
        by_app, app_closed = await _refused_after_shutdown(running, tracing=True)
    async with served(make_settings()) as running:
        at_edge, edge_closed = await _refused_after_shutdown(running, tracing=False)
        assert running.reached == ["POST /predict"], "the refusal was the edge's"
    assert by_app.status == at_edge.status == 503 and app_closed and edge_closed  # type: ignore[attr-defined]
    assert by_app.headers.get("connection") == at_edge.headers.get("connection") == "close"  # type: ignore[attr-defined]


LONG_WINDOW = {
    "server": {"default_timeout_ms": 60_000, "max_timeout_ms": 120_000},
    "batching": {"normal": {"window_ms": 20_000.0, "max_batch": 8, "max_queue": 64}},
}


async def _queued(running: Served, depth: int) -> None:
    batcher = running.service.models["digits"].batcher
    async with asyncio.timeout(10):
        while batcher.queued(Lane.NORMAL) < depth:  # noqa: ASYNC110 (the batcher has no event for it)
            await asyncio.sleep(0.005)


async def _answers(reader: asyncio.StreamReader, count: int) -> list[tuple[str, int, str | None]]:
    """The next ``count`` answers' request ids, statuses and ``Connection`` headers."""
    heads = []
    for _ in range(count):
        head, _ = await asyncio.wait_for(read_response(reader), 10)
        heads.append((head.headers["x-request-id"], head.status, head.headers.get("connection")))
    return heads


async def test_requests_pipelined_behind_one_the_drain_flushes_are_answered_before_the_close(
    make_settings: SettingsFactory,
) -> None:
    """The drain computes the queued request; the two sent behind it on its connection (parsed,
    waiting) get 503 draining; only the last answer says close. (Each answer closing its
    connection during the drain dropped the two, though their bytes had arrived.)"""
    async with served(make_settings(**LONG_WINDOW)) as running:
        reader, writer = await running.connect()
        writer.write(predict(X_Request_ID="a") + predict(X_Request_ID="b") + predict(X_Request_ID="c"))
        await _queued(running, 1)
        draining = asyncio.create_task(running.service.drain(5.0))
        heads = await _answers(reader, 3)
        assert heads == [("a", 200, None), ("b", 503, None), ("c", 503, "close")], heads
        assert await closed(reader)
        writer.close()
        await draining


async def test_requests_pipelined_behind_a_running_one_at_shutdown_are_answered(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None]
) -> None:
    """uvicorn's shutdown (no drain: Ctrl-C, a second SIGTERM) finds a request running and three
    behind it, one parsed and two unread in the socket in one write: all four are answered, the
    last one with close. (The running one's answer closed the connection, and the rest were
    dropped; then the first of the two read together closed it before the second.)"""
    quiet_s(0.0)
    settings = make_settings(**{**LONG_WINDOW, "batching": {"normal": {"window_ms": 300.0, "max_batch": 8}}})
    async with served(settings) as running:
        reader, writer = await running.connect()
        writer.write(predict(X_Request_ID="a") + predict(X_Request_ID="b"))
        await _queued(running, 1)
        protocol = server_side(running, (reader, writer))
        writer.write(predict(X_Request_ID="c") + predict(X_Request_ID="d"))
        arrived_unread(protocol)
        shut_down(running)
        heads = await _answers(reader, 4)
        assert heads == [("a", 200, None), ("b", 200, None), ("c", 200, None), ("d", 200, "close")], heads
        assert await closed(reader)
        writer.close()


async def test_predictions_sent_in_one_write_while_draining_are_each_refused_the_last_closing(
    make_settings: SettingsFactory,
) -> None:
    """The edge refuses the first at its headers, while the other two are still in the read being
    parsed: its answer waits for that read, sees them, and leaves the connection open for them."""
    async with served(make_settings()) as running:
        await running.service.drain(1.0)
        reader, writer = await running.connect()
        writer.write(predict(X_Request_ID="a") + predict(X_Request_ID="b") + predict(X_Request_ID="c"))
        heads = await _answers(reader, 3)
        assert heads == [("a", 503, None), ("b", 503, None), ("c", 503, "close")], heads
        assert await closed(reader)
        writer.close()
        assert running.reached == [], "each refused by the edge"


async def test_clients_connecting_while_the_listeners_close_are_taken_or_refused_never_reset(
    make_settings: SettingsFactory, quiet_s: Callable[[float], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients that keep connecting refilled the backlog during each sweep of it: those that came
    during the last one were reset when the listener closed, often with their request sent."""
    quiet_s(60.0)
    late: list[socket.socket] = []
    sweep = listeners._accept_now

    def sweep_while_clients_connect(listener: socket.socket) -> list[socket.socket]:
        taken = sweep(listener)
        client = socket.socket()  # a client connecting during every sweep, as under steady traffic
        client.setblocking(False)
        client.connect_ex(listener.getsockname())
        late.append(client)
        return taken

    monkeypatch.setattr(listeners, "_accept_now", sweep_while_clients_connect)
    async with served(make_settings()) as running:
        assert running.server is not None
        await running.service.drain(1.0)
        try:
            taken = await close_listeners(running.server)
            await asyncio.sleep(0.2)  # a reset from the close, if any, has reached its client
            reset = [c for c in late if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET]
            assert not reset, f"{len(reset)} of {len(late)} connecting clients reset"
            # the filter drops their SYNs: none completed a handshake, none was taken in a later sweep
            assert taken == 0
            _, writable, _ = select.select([], late, [], 0)
            assert writable == [], "a handshake completed after the sweeps began"
            shut_down(running)
        finally:
            for client in late:
                client.close()


def test_a_listener_refusing_handshakes_keeps_those_waiting_and_completes_no_new_one() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        waiting = socket.create_connection(listener.getsockname())  # completed before: it stays
        listeners._refuse_handshakes(listener)
        late = socket.socket()
        late.setblocking(False)
        try:
            late.connect_ex(listener.getsockname())
            _, writable, _ = select.select([], [late], [], 0.3)
            assert writable == [], "its SYN reached the listener"
            listener.setblocking(False)
            accepted, _ = listener.accept()
            with accepted:
                waiting.sendall(b"ping")
                accepted.setblocking(True)
                assert accepted.recv(4) == b"ping", "a connection made before the filter does not carry it"
            with pytest.raises(BlockingIOError):
                listener.accept()
        finally:
            late.close()
            waiting.close()
