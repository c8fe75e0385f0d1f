"""SIGQUIT stops the real server as SIGTERM does: a drain, then exit 0.

Unhandled, SIGQUIT's default action killed the process at once with a core dump (exit -3):
every request it had accepted was lost without an answer. nginx reads SIGQUIT as its graceful
quit, and a ``STOPSIGNAL SIGQUIT`` sends it on ``docker stop``.
"""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import predict_in_background, signalled_as_it_starts, spawn_digits

pytestmark = pytest.mark.e2e

EXIT_TIMEOUT_S = 60.0


def _queued(url: str) -> int:
    """Requests waiting in the batcher's lanes, as /metrics says."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    return sum(int(float(m)) for m in re.findall(r"^ai_backend_queue_depth\{[^}]*\} (\S+)$", text, re.MULTILINE))


def test_sigquit_drains_the_queued_request_and_exits_0(tmp_path: Path) -> None:
    # a window no test outlasts: the request waits in its lane until the drain flushes it
    window = {"AI_SERVICE_BATCHING__NORMAL__WINDOW_MS": "20000", "AI_SERVICE_SERVER__DEFAULT_TIMEOUT_MS": "60000"}
    server = spawn_digits(tmp_path, window)
    try:
        server.wait_ready()
        with ThreadPoolExecutor(1) as pool:
            answer = predict_in_background(pool, server.url, "held", EXIT_TIMEOUT_S)
            deadline = time.monotonic() + 30
            while _queued(server.url) < 1:
                assert time.monotonic() < deadline and not answer.done(), server.stderr()[-2000:]
                time.sleep(0.02)
            server.process.send_signal(signal.SIGQUIT)
            response = answer.result(timeout=EXIT_TIMEOUT_S)
        code = server.process.wait(timeout=EXIT_TIMEOUT_S)
    finally:
        server.stop()
    stderr = server.stderr()
    assert code == 0, (code, stderr[-3000:])
    assert response.status_code == 200, response.text
    assert response.json()["request_id"] == "held"
    assert "SIGQUIT: draining before shutdown" in stderr


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to see the handler set")
def test_sigquit_while_serve_starts_up_exits_0_saying_so() -> None:
    """As SIGTERM then: nothing to drain yet, start-up stopped, exit 0 (not a core dump, -3)."""
    code, stderr = signalled_as_it_starts(signal.SIGQUIT, EXIT_TIMEOUT_S)
    assert code == 0, (code, stderr[-2000:])
    assert "Traceback" not in stderr
    assert "SIGQUIT before the server started" in stderr, stderr[-2000:]
