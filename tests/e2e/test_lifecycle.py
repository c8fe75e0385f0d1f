"""The real server's lifecycle over HTTP: disconnects, deadlines, and SIGTERM with work queued or under load.

Each scenario gets its own ``python -m app.cli serve`` on a free loopback port (a SIGTERM
test consumes its server; the deadline test needs one on which no batch has run yet). The
processes are spawned together, so that their torch imports overlap, and each test waits
for its own to be ready; all are stopped in ``finally``. Every loop is bounded in count and
in time, and nothing asserts on how long anything took: timeouts only turn a hang into a
failure.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import HOST, ServerProcess, spawn
from tests.support import MODEL_NAME, sample_png, server_environment, top_label

pytestmark = pytest.mark.e2e

GRACE_S = 10.0  # AI_SERVICE_SERVER__SHUTDOWN_GRACE_S of the servers that get SIGTERM
EXIT_SLACK_S = 20.0  # on top of the grace: uvicorn's own grace, lifespan close, interpreter exit
CLIENT_TIMEOUT_S = 30.0  # longer than any wait the server may legitimately impose: a hang fails
PNG = sample_png(7)
MAX_PROBES = 500  # readiness probes after a SIGTERM, at most
PNG_HEADERS = {"Content-Type": "image/png"}

# A normal lane whose window is far longer than anything the tests wait for: requests sit
# in the queue until something other than the window (a drain, a disconnect, a deadline)
# moves them. The window must stay below the admission headroom's share of the default
# timeout (a settings rule: 0.5 x the default by default).
LONG_WINDOW = {
    "AI_SERVICE_BATCHING__NORMAL__WINDOW_MS": "2000",
    "AI_SERVICE_BATCHING__NORMAL__MAX_BATCH": "64",
    "AI_SERVICE_BATCHING__NORMAL__MAX_QUEUE": "1024",
    "AI_SERVICE_SERVER__DEFAULT_TIMEOUT_MS": "30000",
}
# For the queued drain the window (20 s) is longer than the grace (10 s): if the drain waited
# for the window instead of flushing the queue, the grace would end first and the queued
# requests would get 503 instead of 200. That proves "at once" without timing anything.
DRAIN_WINDOW = {
    **LONG_WINDOW,
    "AI_SERVICE_BATCHING__NORMAL__WINDOW_MS": "20000",
    "AI_SERVICE_SERVER__DEFAULT_TIMEOUT_MS": "60000",
    "AI_SERVICE_SERVER__SHUTDOWN_GRACE_S": str(GRACE_S),
}
# The disconnect test closes its socket after seeing the request queued (a scrape away): on a
# loaded machine that took longer than 2 s once, and the window computed the request first.
DISCONNECT_WINDOW = {**LONG_WINDOW, "AI_SERVICE_BATCHING__NORMAL__WINDOW_MS": "8000"}
STEADY = {
    "AI_SERVICE_BATCHING__NORMAL__WINDOW_MS": "25",
    "AI_SERVICE_SERVER__SHUTDOWN_GRACE_S": str(GRACE_S),
}


# --- processes ----------------------------------------------------------------------------


def _log_records(stderr: str) -> list[dict[str, object]]:
    """The server's JSON log lines, parsed (anything else on stderr is skipped)."""
    records = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


@dataclass
class Server(ServerProcess):
    def wait_exit(self) -> int:
        try:
            return self.process.wait(timeout=GRACE_S + EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit after SIGTERM:\n{self.stderr()[-4000:]}")


def _spawn(logs: Path, env: dict[str, str]) -> Server:
    return Server(spawn(logs, env), logs)


def _stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every process still running (all at once: each takes a while to exit), then SIGKILL."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    for process in running:
        try:
            process.wait(timeout=GRACE_S + EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """One process per scenario, started together so that their torch imports overlap."""
    scenarios = {
        "deadline": LONG_WINDOW,
        "disconnect": DISCONNECT_WINDOW,
        "queued_drain": DRAIN_WINDOW,
        "interrupted": DRAIN_WINDOW,
        "steady": STEADY,
        "steady_impolite": STEADY,
    }
    started: dict[str, Server] = {}
    try:
        for name, env in scenarios.items():
            started[name] = _spawn(tmp_path_factory.mktemp(name), server_environment(env))
        yield started
    finally:
        _stop_all([server.process for server in started.values()])


def _ready(servers: dict[str, Server], name: str) -> Server:
    server = servers[name]
    server.wait_ready()
    return server


def _ready_alone(servers: dict[str, Server], name: str) -> Server:
    """``name`` once every process has started, so that load on it competes with no start-up."""
    for other in servers.values():
        if other is not servers[name] and other.process.poll() is None:
            other.wait_ready()
    servers[name].wait_ready()
    return servers[name]


# --- metrics ------------------------------------------------------------------------------

Samples = list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


def _scrape(client: httpx.Client) -> Samples:
    """Every sample of /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    ]


def _value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the series of ``name`` that carry ``labels`` (and any others: a series may
    gain a label, say the model version, without changing what these tests count); 0 when
    there is none yet (a counter never incremented)."""
    return sum(
        value
        for sample, have, value in samples
        if sample == name and all(have.get(key) == wanted for key, wanted in labels.items())
    )


def _queue_depth(client: httpx.Client) -> float:
    return _value(_scrape(client), "ai_backend_queue_depth", model=MODEL_NAME, lane="normal")


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Until ``condition()`` holds. The server exposes no event to wait on, so this polls;
    the condition holds within milliseconds and the timeout only bounds a failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


# --- outcomes -----------------------------------------------------------------------------

RESET_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, ConnectionResetError)


@dataclass(frozen=True)
class Outcome:
    """What one request got: a status (and for errors the envelope's code), or an exception."""

    sent_at: float  # time.monotonic() when the client started the request
    done_at: float  # ... and when it had the answer or the error
    status: int | None = None
    code: str | None = None
    retry_after: str | None = None
    error: str | None = None  # the exception's type name
    batch_size: int | None = None  # of a 200 prediction

    @property
    def refused(self) -> bool:
        return self.error == "ConnectError"


def _send(client: httpx.Client, method: str, path: str, **kwargs: object) -> Outcome:
    sent_at = time.monotonic()
    try:
        response = client.request(method, path, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as exc:
        return Outcome(sent_at, time.monotonic(), error=type(exc).__name__)
    done_at = time.monotonic()
    code = batch_size = None
    if response.status_code >= 400:
        code = response.json().get("code")
    elif path.endswith("predict"):
        assert top_label(response.json()) == "7", response.text
        batch_size = response.json()["batch_size"]
    return Outcome(
        sent_at, done_at, response.status_code, code, response.headers.get("retry-after"), batch_size=batch_size
    )


def _check_503s(outcomes: list[Outcome], allowed: set[str]) -> None:
    for outcome in outcomes:
        if outcome.status == 503:
            assert outcome.code in allowed, outcome
            assert outcome.retry_after is not None and int(outcome.retry_after) >= 1, outcome


# --- 1. A long window: a gone client, a passed deadline -----------------------------------


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def test_client_disconnect_cancels_the_queued_request(servers: dict[str, Server]) -> None:
    server = _ready(servers, "disconnect")
    cancelled = "ai_backend_cancellations_total"
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
        before = _scrape(client)
        request = (
            f"POST /predict HTTP/1.1\r\nHost: {HOST}:{server.port}\r\nContent-Type: image/png\r\n"
            f"Content-Length: {len(PNG)}\r\nX-Request-ID: gone\r\n\r\n"
        ).encode() + PNG
        with socket.create_connection((HOST, server.port), timeout=CLIENT_TIMEOUT_S) as raw:
            raw.sendall(request)
            # decoded and waiting in the queue (not still decoding) before the client goes
            _wait_for(lambda: _queue_depth(client) == 1, "the raw request to be queued")
        # the socket is closed now, well within the 8 s window

        def left_the_queue() -> bool:
            now = _scrape(client)
            gone = _delta(before, now, cancelled, reason="cancelled") >= 1
            return gone and _value(now, "ai_backend_queue_depth", model=MODEL_NAME, lane="normal") == 0

        _wait_for(left_the_queue, "the disconnected request to leave the queue")

        answered = client.post("/predict", content=PNG, headers={**PNG_HEADERS, "X-Request-ID": "stays"})
        assert answered.status_code == 200, answered.text
        assert answered.json()["batch_size"] == 1 and top_label(answered.json()) == "7"
        after = _scrape(client)

    assert _delta(before, after, cancelled, reason="cancelled") == 1
    assert _delta(before, after, cancelled, reason="deadline") == 0
    # one batch, holding only the request that stayed: the gone one was never computed
    assert _delta(before, after, "ai_backend_batch_size_count", lane="normal") == 1
    assert _delta(before, after, "ai_backend_batch_size_sum", lane="normal") == 1
    assert _delta(before, after, "ai_backend_batch_size_count", lane="urgent") == 0
    # the server logged the gone request as 499 (client closed request)
    assert [r["status"] for r in _log_records(server.stderr()) if r.get("request_id") == "gone"] == [499]


def _predict_with_deadline(client: httpx.Client, millis: int, request_id: str) -> httpx.Response:
    headers = {**PNG_HEADERS, "X-Request-Timeout": str(millis), "X-Request-ID": request_id}
    return client.post("/predict", content=PNG, headers=headers)


def test_a_deadline_shorter_than_the_window_is_served_within_it(servers: dict[str, Server]) -> None:
    """X-Request-Timeout: 200 against a 2 s window, on a fresh server and once a batch is timed.

    It was answered 503 both times, never computed: ``deadline_exceeded`` in the queue on the fresh
    server (no batch latency to predict with), ``would_miss_deadline`` at admission after (the
    window alone outlasted the deadline). It hurries now: its lane's batch goes at once.
    """
    server = _ready(servers, "deadline")
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
        fresh = _scrape(client)
        assert _value(fresh, "ai_backend_batch_size_count", lane="normal") == 0, "not a fresh server"
        assert _value(fresh, "ai_backend_batch_size_count", lane="urgent") == 0, "not a fresh server"
        untimed = _predict_with_deadline(client, 200, "hurried-untimed")
        timed = _predict_with_deadline(client, 200, "hurried-timed")
        after = _scrape(client)

    for answer in (untimed, timed):
        assert answer.status_code == 200, answer.text
        assert answer.json()["timings"]["queue"] < 200
    assert _delta(fresh, after, "ai_backend_batch_size_count", lane="normal") == 2  # each computed once
    assert _delta(fresh, after, "ai_backend_cancellations_total", reason="deadline") == 0
    assert _delta(fresh, after, "ai_backend_rejections_total", reason="would_miss_deadline") == 0
    assert _value(after, "ai_backend_queue_depth", model=MODEL_NAME, lane="normal") == 0


# --- 2. SIGTERM with requests waiting in the queue ----------------------------------------

QUEUED = 10


def _queue(server: Server, pool: ThreadPoolExecutor, control: httpx.Client) -> list[Future[Outcome]]:
    """``QUEUED`` predictions sent on connections of their own (ids q0, q1, ...), once all are queued."""

    def one(index: int) -> Outcome:
        with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            return _send(client, "POST", "/predict", content=PNG, headers={**PNG_HEADERS, "X-Request-ID": f"q{index}"})

    queued = [pool.submit(one, i) for i in range(QUEUED)]
    _wait_for(lambda: _queue_depth(control) == QUEUED, f"{QUEUED} requests queued")
    return queued


def test_sigterm_flushes_the_queue_at_once_then_refuses_new_work(servers: dict[str, Server]) -> None:
    server = _ready(servers, "queued_drain")
    with (
        httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as control,
        ThreadPoolExecutor(QUEUED, thread_name_prefix="queued") as pool,
    ):
        queued = _queue(server, pool, control)
        assert not any(f.done() for f in queued)  # the window (20 s) holds them

        server.process.send_signal(signal.SIGTERM)
        sigterm_returned = time.monotonic()
        # readiness turns 503 first; a prediction sent after that is refused with 503 draining,
        # unless the listener has closed by then (draining 10 requests is quick): refused
        readiness: list[Outcome] = []
        late: Outcome | None = None
        for _ in range(MAX_PROBES):
            with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
                probe = _send(client, "GET", "/readyz")
            readiness.append(probe)
            if probe.status == 503:
                with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
                    late = _send(
                        client, "POST", "/predict", content=PNG, headers={**PNG_HEADERS, "X-Request-ID": "late"}
                    )
            if probe.error is not None or late is not None:
                break
            time.sleep(0.002)
        results = [f.result(timeout=GRACE_S + EXIT_SLACK_S) for f in queued]
        code = server.wait_exit()

    stderr = server.stderr()
    assert code == 0, stderr[-4000:]
    # all flushed in one batch, not failed when the grace ran out (the window is longer than the grace)
    assert all(r.status == 200 for r in results), results
    assert [r.batch_size for r in results] == [QUEUED] * QUEUED, results  # together, in one batch
    assert all(r.sent_at < sigterm_returned for r in results)
    assert all(p.status == 503 or p.refused for p in readiness), readiness  # never 200 after SIGTERM
    _check_503s(readiness, {"not_ready", "model_not_ready"})
    if late is not None:
        assert late.refused or (late.status, late.code) == (503, "draining"), late
        _check_503s([late], {"draining"})
    assert "drained" in stderr and "Application shutdown complete" in stderr, stderr[-4000:]
    assert '"level": "ERROR"' not in stderr and '"level": "CRITICAL"' not in stderr, stderr[-4000:]


def test_ctrl_c_answers_what_it_cuts_off_503_draining_and_exits_130(servers: dict[str, Server]) -> None:
    """SIGINT stops at once, with no grace: the queued requests are not computed, and each is
    answered 503 ``draining`` in the envelope (not uvicorn's plain-text 500); the process ends
    as a Ctrl-C does, with 130 and no traceback."""
    server = _ready(servers, "interrupted")
    with (
        httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as control,
        ThreadPoolExecutor(QUEUED, thread_name_prefix="interrupted") as pool,
    ):
        queued = _queue(server, pool, control)
        server.process.send_signal(signal.SIGINT)
        results = [f.result(timeout=GRACE_S + EXIT_SLACK_S) for f in queued]
        code = server.wait_exit()

    stderr = server.stderr()
    assert [(r.status, r.code) for r in results] == [(503, "draining")] * QUEUED, results
    _check_503s(results, {"draining"})
    assert code == 130, stderr[-4000:]
    assert "Traceback" not in stderr and "Exception in ASGI application" not in stderr, stderr[-4000:]
    # a documented outcome, said once at WARNING: uvicorn's own line for it was an ERROR (paging on-call)
    assert '"level": "ERROR"' not in stderr, stderr[-4000:]
    assert "still running cut off" in stderr, stderr[-4000:]


# --- 3. SIGTERM under steady load ---------------------------------------------------------

WORKERS = 16
MAX_REQUESTS_PER_WORKER = 20_000  # a bound, far above what a few seconds allow
LOAD_TIME_LIMIT_S = 60.0  # a worker gives up after this, whatever it sees
MAX_BACKOFF_S = 2.0


@dataclass
class LoadRun:
    """What a SIGTERM under load left behind."""

    exit_code: int
    sigterm_sent: float  # time.monotonic() just before send_signal: a request after it may meet the close
    sigterm_returned: float  # time.monotonic() once send_signal returned
    workers: list[list[Outcome]]  # each worker's requests, in order
    probes: list[Outcome]  # /readyz probes sent after SIGTERM
    stderr: str

    @property
    def outcomes(self) -> list[Outcome]:
        return [o for w in self.workers for o in w]

    def summary(self) -> Counter[str]:
        return Counter(o.error or f"{o.status} {o.code or ''}".strip() for o in self.outcomes)


def _sigterm_under_load(server: Server, *, honour_retry_after: bool) -> LoadRun:
    """``WORKERS`` clients send predictions in a loop, each on its own keep-alive connection;
    after about a second the server gets SIGTERM. A worker stops at its first transport
    error (refused once the listener closed, or worse). A thread probes /readyz from the
    moment SIGTERM was sent until its first answer or refusal."""
    stop = threading.Event()  # set only when the test bails out: workers then stop at once

    def worker(index: int, outcomes: list[Outcome]) -> list[Outcome]:
        limit = time.monotonic() + LOAD_TIME_LIMIT_S
        with httpx.Client(
            base_url=server.url, timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=1)
        ) as client:
            for n in range(MAX_REQUESTS_PER_WORKER):
                if stop.is_set() or time.monotonic() > limit:
                    break
                headers = {**PNG_HEADERS, "X-Request-ID": f"w{index}-{n}"}
                outcome = _send(client, "POST", "/predict", content=PNG, headers=headers)
                outcomes.append(outcome)
                if outcome.error is not None:
                    break
                if honour_retry_after and outcome.retry_after is not None:
                    stop.wait(min(float(outcome.retry_after), MAX_BACKOFF_S))
        return outcomes

    def probe_readiness(after: float) -> list[Outcome]:
        probes: list[Outcome] = []
        for _ in range(MAX_PROBES):
            if stop.is_set():
                break
            with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
                probe = _send(client, "GET", "/readyz")
            assert probe.sent_at >= after
            probes.append(probe)
            if probe.error is not None or probe.status != 200:
                break
            time.sleep(0.005)
        return probes

    with ThreadPoolExecutor(WORKERS + 1, thread_name_prefix="load") as pool:
        so_far: list[list[Outcome]] = [[] for _ in range(WORKERS)]
        futures = [pool.submit(worker, i, so_far[i]) for i in range(WORKERS)]
        try:
            # every worker answered (the first batch also loads the lazy head), then about a second more;
            # a worker that stops first (a transport error, a failed check) ends the wait with its story
            _wait_for(
                lambda: any(f.done() for f in futures) or all(any(o.status == 200 for o in w) for w in so_far),
                "every worker to get a 200",
            )
            time.sleep(1.0)
            ended = {i: f for i, f in enumerate(futures) if f.done()}
            assert not ended, "workers stopped before SIGTERM: " + "; ".join(
                f"worker {i}: {f.exception()!r} after {so_far[i][-3:]}" for i, f in ended.items()
            )
            sigterm_sent = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            sigterm_returned = time.monotonic()
            probing = pool.submit(probe_readiness, sigterm_returned)
            code = server.wait_exit()
        finally:
            if server.process.poll() is None:
                stop.set()
        workers = [f.result(timeout=LOAD_TIME_LIMIT_S + CLIENT_TIMEOUT_S) for f in futures]
        probes = probing.result(timeout=LOAD_TIME_LIMIT_S + CLIENT_TIMEOUT_S)
    return LoadRun(code, sigterm_sent, sigterm_returned, workers, probes, server.stderr())


def _check_drained_cleanly(run: LoadRun) -> None:
    """What holds for any client: exit 0, answers were 200 or a 503 with a code and
    Retry-After, no timeouts, no 200 once readiness said 503, and the log tells the story."""
    summary, stderr = run.summary(), run.stderr
    assert run.exit_code == 0, f"exit code {run.exit_code}; outcomes {summary}:\n{stderr[-4000:]}"
    # the load was real: every worker had answers before SIGTERM
    assert all(any(o.status == 200 and o.sent_at < run.sigterm_returned for o in w) for w in run.workers), summary
    assert all(o.status in (200, 503) for o in run.outcomes if o.error is None), summary
    _check_503s(run.outcomes, {"draining", "model_not_ready", "queue_full"})
    assert not [o for o in run.outcomes + run.probes if o.error is not None and "Timeout" in o.error], summary
    # every worker ended at a transport error, sent after SIGTERM: the listener closed
    # (a worker may send between send_signal's syscall and the clock read after it: the bound is
    # the clock read before it)
    last = [w[-1] if w else None for w in run.workers]
    early = [o for o in last if o is None or o.error is None or o.sent_at <= run.sigterm_sent]
    assert not early, f"{summary}; last outcomes not a transport error after SIGTERM: " + ", ".join(
        f"{o.error or o.status} sent {o.sent_at - run.sigterm_sent:+.4f} s from SIGTERM" if o else "none" for o in early
    )
    # once readiness said 503, no prediction sent after that got a 200: new work is refused
    not_ready = [p.done_at for p in run.probes if p.status == 503]
    if not_ready:
        assert not [o for o in run.outcomes if o.status == 200 and o.sent_at > min(not_ready)], summary
    # readiness, probed from SIGTERM on: 503 when it answers, never 200 (or the listener had closed)
    assert run.probes, "no readiness probe"
    assert all(p.status == 503 for p in run.probes if p.error is None), run.probes
    _check_503s(run.probes, {"not_ready", "model_not_ready"})
    assert "drained" in stderr and "Application shutdown complete" in stderr, stderr[-4000:]
    assert '"level": "ERROR"' not in stderr and '"level": "CRITICAL"' not in stderr, stderr[-4000:]


# how long before the first refused connection (the listener closing) a reset may start: the
# client's connect and send, and uvicorn closing the listener and then its connections
CLOSE_INSTANT_S = 1.0


def test_sigterm_under_steady_load_drains_and_only_refuses(servers: dict[str, Server]) -> None:
    """Clients that honour Retry-After: the drain resets nothing, and each ends refused once the
    listener closes. One whose wait after a 503 ends right at that instant can be reset instead
    (see the next test); a reset at any other moment fails. Seen on a loaded CI host, where the
    drain took about as long as the one-second Retry-After, before the server took its
    listener's backlog and answered the requests on their way at shutdown."""
    server = _ready_alone(servers, "steady")
    run = _sigterm_under_load(server, honour_retry_after=True)
    _check_drained_cleanly(run)
    summary = run.summary()
    transport_errors = [o for o in run.outcomes + run.probes if o.error is not None]
    refusals = [o.sent_at for o in transport_errors if o.refused]
    assert refusals, f"no worker was refused: {summary}"
    closed_at = min(refusals)
    at_close = {exc.__name__ for exc in RESET_ERRORS}
    for outcome in transport_errors:
        if not outcome.refused:
            assert outcome.error in at_close, f"{outcome} instead of refused: {summary}"
            assert outcome.sent_at >= closed_at - CLOSE_INSTANT_S, f"reset before the listener closed: {outcome}"
    assert sum(1 for w in run.workers if w[-1].refused) >= WORKERS // 2, summary


def test_sigterm_under_load_from_clients_ignoring_retry_after(servers: dict[str, Server]) -> None:
    """Clients that ignore Retry-After and send again at once, right up to the listener closing.

    The server takes what waits in its listener's backlog before closing it, and answers the
    request on its way on each connection (``app.connection``), so a worker normally ends with a
    503 ``draining`` and then a refused connection. A reset remains possible at the very
    instant the listener closes (a handshake completed between the server's last look at its
    backlog and the close) or for a request that comes after its connection was quiet for half
    a second. No server can answer a client that keeps sending through that instant; what must
    hold anyway is: exit 0, no hang, no timeout, only 200 or a coded 503 as answers, and a
    transport error only as a worker's last request, sent after SIGTERM.
    """
    server = _ready_alone(servers, "steady_impolite")
    run = _sigterm_under_load(server, honour_retry_after=False)
    _check_drained_cleanly(run)
    allowed = {"ConnectError", *(exc.__name__ for exc in RESET_ERRORS)}
    errors = [o for o in run.outcomes + run.probes if o.error is not None]
    assert all(o.error in allowed for o in errors), run.summary()
