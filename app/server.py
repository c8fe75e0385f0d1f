"""The HTTP server: uvicorn, taught to drain on SIGTERM before it stops listening.

Plain uvicorn stops accepting connections the moment SIGTERM arrives, then re-raises the
signal so the process dies by it. A deploy wants the opposite order: readiness turns 503
and new predictions get 503 ``draining`` while queued and running requests finish (within
the grace period), and only then does the listener close and the process exit 0.
SIGQUIT does the same (nginx's graceful quit: a supervisor or ``docker stop`` with a
``STOPSIGNAL SIGQUIT`` asks for a stop, and unhandled it killed the process at once with a core
dump, every accepted request lost without an answer). A second SIGTERM or SIGQUIT, or SIGINT,
stops at once: what still runs is answered 503 ``draining``, and a batch still running on a
device thread is abandoned, not awaited (``InferenceService.halt``), whatever the grace.

As it stops, a request that had just arrived is answered, not cut off: on an open connection
(``app.connection.ClosingProtocol``), or on one still waiting in the listener's backlog, which
``DrainingServer`` takes before closing the listener (``app.listeners.close_listeners``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType

import uvicorn

from app.healthcheck import forget_served_address, write_served_address
from app.listeners import close_listeners

log = logging.getLogger(__name__)

Drain = Callable[[], Awaitable[None]]

# the signals that drain before the server stops: SIGTERM (Kubernetes, docker stop) and SIGQUIT
# (nginx's graceful quit); a second one of either stops at once
DRAINING_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGTERM", "SIGQUIT") if hasattr(signal, name))

# uvicorn's wait for open connections once the drain is over: the answers being written, and a
# closing connection's wait for a request begun (``app.connection``'s QUIET_S, LAST_REQUEST_S),
# not a second grace
DRAINED_CLOSE_S = 3


SHUTDOWN_CUT = "Task cancelled, timeout graceful shutdown exceeded"  # uvicorn's message to what it cancels


def shutdown_cuts_told(record: logging.LogRecord) -> bool:
    """A filter for uvicorn's log: what its shutdown cuts off once the wait for open connections
    ends (``DRAINED_CLOSE_S`` after the drain, or at once on Ctrl-C) is a documented outcome, not
    an error: the requests still running are answered 503 draining where their answer had not
    started, and an answer a client was not reading is cut. uvicorn logs the first at ERROR (even
    "Cancel 0", with nothing cut), and a traceback for the second: operators who alert on ERROR
    were paged by every rollout that met a slow client. Each is one line of ours instead."""
    if record.levelno < logging.ERROR:
        return True
    if isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"):
        cut = record.args[0] if isinstance(record.args, tuple) and record.args else 0
        record.levelno, record.levelname = (logging.WARNING, "WARNING") if cut else (logging.INFO, "INFO")
        record.msg, record.args = (
            "shutdown: the wait for open connections ended: %s request(s) still running cut off",
            (cut,),
        )
        return True
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, asyncio.CancelledError) and SHUTDOWN_CUT in error.args:
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "shutdown: an answer its client was not reading was cut off",
            (),
            None,
            None,
        )
    return True


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM (or SIGQUIT) drains the service first and ends with exit code 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain, halt: Callable[[], None] = lambda: None) -> None:
        """``drain``: SIGTERM's and SIGQUIT's, awaited before the server stops. ``halt``: SIGINT's, called on
        the event loop as the server stops at once (what it cuts off is then answered 503)."""
        super().__init__(config)
        self._drain = drain
        self._halt = halt
        self.interrupted = False  # a Ctrl-C (SIGINT) stopped it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None
        self._drain_asked = False
        self._at_once = False  # a second signal or Ctrl-C: nothing waits any more

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # where it listens, as fields: started on port 0 (any free port), the log is the only
        # place that says which one (uvicorn's own line has it in its text alone)
        addresses = [listener.getsockname()[:2] for listening in self.servers for listener in listening.sockets]
        for host, port in addresses:
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            log.info("listening on %s", url, extra={"host": host, "port": port})
        if addresses:  # for the container's health check (``app.healthcheck``)
            try:
                await asyncio.to_thread(write_served_address, *addresses[0])
            except OSError as exc:  # a temporary directory not writable: the check reads the settings
                log.warning("cannot write the address for the health check: %s", exc)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers (SIGINT, SIGTERM), and SIGQUIT's: its default action dumps core."""
        with super().capture_signals():
            quit_signal = getattr(signal, "SIGQUIT", None)
            if quit_signal is None or threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(quit_signal, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(quit_signal, previous)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig not in DRAINING_SIGNALS or self._loop is None:
            self.interrupted = self.interrupted or sig == signal.SIGINT
            self._stop_at_once()  # Ctrl-C
            if sig in DRAINING_SIGNALS and sig != signal.SIGTERM:
                self.should_exit = True  # not recorded: raised again at exit, SIGQUIT would dump core
                return
            super().handle_exit(sig, frame)
            return
        # A signal handler runs in whatever context the main thread was in, a request's among
        # them: its log lines and the drain belong to no request and to no request's trace.
        contextvars.Context().run(self._on_stop_signal, self._loop, signal.Signals(sig).name)

    def _on_stop_signal(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it and the process would die by
        # it (SIGTERM: exit code 143; SIGQUIT: a core dump)
        if self._drain_asked or self.should_exit:
            log.warning("second %s: stopping without waiting for the drain", name)
            self._stop_at_once()
            self.should_exit = True
            return
        self._drain_asked = True
        log.info("%s: draining before shutdown", name)
        loop.call_soon_threadsafe(self._start_drain)  # in this context: a new one

    def _stop_at_once(self) -> None:
        """What still runs is answered 503 draining now: by the service first (``halt``: its
        batchers closed with no grace, a drain under way ended, a batch held on a device thread
        abandoned), then by uvicorn, which waits for no open request."""
        self._at_once = True
        self.config.timeout_graceful_shutdown = 0
        if self._loop is not None:  # the service says so first: 503 draining, not uvicorn's 500
            self._loop.call_soon_threadsafe(contextvars.Context().run, self._halt)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(forget_served_address)
        taken = await close_listeners(self)
        if taken:
            log.info("took %d connection(s) waiting in the listener's backlog before closing it", taken)
        await super().shutdown(sockets)  # its own closing of the listeners finds them closed

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("drain failed; shutting down anyway")
        finally:
            # the drain took the grace period (or ended with nothing left to wait for): uvicorn's
            # own wait for open connections gets DRAINED_CLOSE_S for the answers being written,
            # not a second grace period; what still runs then is cancelled and answered 503 draining.
            # A drain a second signal ended (``halt``) leaves it at none
            if not self._at_once:
                self.config.timeout_graceful_shutdown = DRAINED_CLOSE_S
            self.should_exit = True
