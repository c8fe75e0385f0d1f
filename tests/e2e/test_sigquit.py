"""SIGQUIT stops the real server as SIGTERM does: a drain, then exit 0.

Unhandled, SIGQUIT's default action killed the process at once with a core dump (exit -3):
every request it had accepted was lost without an answer. nginx reads SIGQUIT as its graceful
quit, and a ``STOPSIGNAL SIGQUIT`` sends it on ``docker stop``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import spawn_digits
from tests.support import REPO_ROOT, sample_png, server_environment

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
            answer = pool.submit(
                httpx.post,
                f"{server.url}/predict",
                content=sample_png(7),
                headers={"Content-Type": "image/png", "X-Request-ID": "held"},
                timeout=EXIT_TIMEOUT_S,
            )
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


def _catches(pid: int, signum: int) -> bool:
    """The process has a handler of its own for ``signum`` (``SigCgt`` in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to see the handler set")
def test_sigquit_while_serve_starts_up_exits_0_saying_so() -> None:
    """As SIGTERM then: nothing to drain yet, start-up stopped, exit 0 (not a core dump, -3)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve"],
        cwd=REPO_ROOT,
        env=server_environment({"PYTHONPATH": str(REPO_ROOT), "AI_SERVICE_SERVER__PORT": "0"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not _catches(process.pid, signal.SIGTERM):  # start-up has begun (SIGQUIT's handler, old or new, set)
            assert process.poll() is None and time.monotonic() < deadline, "serve never set its handler"
            time.sleep(0.005)
        time.sleep(0.05)  # set next to SIGTERM's
        process.send_signal(signal.SIGQUIT)
        _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert process.returncode == 0, (process.returncode, stderr[-2000:])
    assert "Traceback" not in stderr
    assert "SIGQUIT before the server started" in stderr, stderr[-2000:]
