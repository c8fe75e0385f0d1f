"""The listeners closed at shutdown, having taken the connections waiting in their backlogs.

Closing a listener resets the connections the kernel completed that were not accepted yet:
``DrainingServer`` takes them first (``close_listeners``), so that they are answered too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import struct
import sys

import uvicorn

SWEEPS = 8  # of the listeners' backlogs at shutdown, a bound: only handshakes under way can still land
SO_ATTACH_FILTER = 26  # Linux's socket option for a classic BPF filter
# one instruction, BPF_RET | BPF_K with 0: keep no byte of any packet (drop it)
_DROP_EVERYTHING = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))


def _refuse_handshakes(listener: socket.socket) -> None:
    """From now on no handshake completes on ``listener`` (Linux: a socket filter that drops every
    packet reaching it), so its backlog can only shrink while it is swept. A client connecting now
    has its SYN dropped, retries it, and is refused once the listener is closed: it never has a
    connection that the close resets after it sent its request. The connections already in the
    backlog were made before the filter and do not carry it. Elsewhere, nothing is done."""
    if sys.platform != "linux":
        return
    program = struct.pack("HL", 1, ctypes.addressof(_DROP_EVERYTHING))  # struct sock_fprog
    with socket.socket(fileno=os.dup(listener.fileno())) as sock, contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, program)


def _accept_now(listener: socket.socket) -> list[socket.socket]:
    """The connections the kernel has completed on ``listener`` and nobody has accepted yet."""
    taken: list[socket.socket] = []
    with socket.socket(fileno=os.dup(listener.fileno())) as sock:  # the same listener, not its owner
        sock.setblocking(False)
        while True:
            try:
                connection, _ = sock.accept()
            except ConnectionAbortedError:  # reset by its client before it was taken: the next one
                continue
            except OSError:  # none left (EAGAIN), or no descriptor for one more
                return taken
            connection.setblocking(False)
            taken.append(connection)


async def close_listeners(server: uvicorn.Server) -> int:
    """Close ``server``'s listeners, having accepted what waited in their backlogs, as uvicorn
    would have; and say how many that was.

    Closing a listener resets every connection the kernel completed that was not accepted
    yet; its client, who connected in time, gets a reset instead of an answer. Taken first,
    such a connection is shut down with the others: open for its first request (see
    ``ClosingProtocol``), which is answered. The listeners close right after the last look at
    their backlogs, and no new handshake completes once the sweeps begin (``_refuse_handshakes``),
    so clients that keep connecting cannot refill them. Under TLS nothing is taken (a handshake
    could hold the exit).
    """
    config = server.config
    servers: list[asyncio.AbstractServer] = getattr(server, "servers", [])
    loop = asyncio.get_running_loop()

    def protocol() -> asyncio.Protocol:  # uvicorn's own factory is local to its ``startup``: the same one
        made: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=server.server_state, app_state=server.lifespan.state, _loop=loop
        )
        return made

    listeners = [listener for listening in servers for listener in getattr(listening, "sockets", None) or ()]
    sweeps = SWEEPS if config.ssl is None else 0
    for listener in listeners if sweeps else ():
        _refuse_handshakes(listener)
    taken = 0
    for _ in range(sweeps):  # each await lets a handshake under way land: swept again, boundedly
        waiting = [connection for listener in listeners for connection in _accept_now(listener)]
        if not waiting:
            break
        for connection in waiting:
            try:
                await loop.connect_accepted_socket(protocol, connection)
            except OSError:  # reset by its client meanwhile
                connection.close()
                continue
            taken += 1
    for listening in servers:
        listening.close()
    return taken
