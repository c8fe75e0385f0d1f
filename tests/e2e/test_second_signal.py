"""A second signal bounds the exit of the real server, whatever the grace, with a batch held on its
device thread (a device call that hangs).

The first SIGTERM drains: the held batch's request waits, within the grace. A second SIGTERM (or a
Ctrl-C) stops at once: that request was answered 503 draining at once, but the lifespan's close
drained again with the full grace, waiting for the batch nobody awaited any more: up to the grace
(an hour here), and for ever with no limit, so the process never exited.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.server import HOST, ServerProcess, predict_in_background
from tests.support import REPO_ROOT, copy_repository, server_environment

pytestmark = pytest.mark.e2e

LONG_GRACE_S = "3600"  # longer than any test: only the second signal can end the drain
STEP_TIMEOUT_S = 60.0
KILL_AFTER_S = 20.0  # still running then: failed (before the fix it waited out the grace, or for ever)

# the server with each batch held on its device thread for an hour (``time.sleep`` stands for a
# device call that hangs); ``no_limit`` drains with no time limit (``server.shutdown_grace_s``
# takes only seconds: None is the Python API's, as InferenceService.drain and close take it)
_SERVE_HELD = """
import sys
import time

from app import service
from app.inference import loader


def held(self, images, head=None):
    print("batch held on the device thread", file=sys.stderr, flush=True)
    time.sleep(3600)


loader.LayeredModel.probabilities = held
if sys.argv[1] == "no_limit":
    drain = service.InferenceService.drain

    async def no_limit(self, grace_s):
        await drain(self, None)

    service.InferenceService.drain = no_limit
from app.cli import main

sys.exit(main(["serve", "--host", sys.argv[2], "--port", "0"]))
"""


def _spawn(tmp_path: Path, grace: str) -> ServerProcess:
    script = tmp_path / "serve_held.py"
    script.write_text(_SERVE_HELD)
    env = {
        "PYTHONPATH": str(REPO_ROOT),
        "AI_SERVICE_MODEL__REPOSITORY": str(copy_repository(tmp_path)),
        "AI_SERVICE_MODEL__WARMUP": "false",
        "AI_SERVICE_MODEL__DEVICE_WORKERS": "1",
        "AI_SERVICE_MODEL__URGENT_WORKERS": "0",
        "AI_SERVICE_SERVER__DEFAULT_TIMEOUT_MS": "60000",
        "AI_SERVICE_SERVER__SHUTDOWN_GRACE_S": LONG_GRACE_S,
        # spans reach stdout only when the shutdown flushes them
        "AI_SERVICE_TELEMETRY__EXPORTER": "console",
        "AI_SERVICE_TELEMETRY__SCHEDULE_DELAY_MS": "3600000",
    }
    arguments = [sys.executable, str(script), "no_limit" if grace == "none" else "grace", HOST]
    with (tmp_path / "stdout.log").open("wb") as out, (tmp_path / "stderr.log").open("wb") as err:
        process = subprocess.Popen(arguments, cwd=REPO_ROOT, env=server_environment(env), stdout=out, stderr=err)
    return ServerProcess(process, tmp_path)


def _wait_for(server: ServerProcess, text: str) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while text not in server.stderr():
        assert server.process.poll() is None, server.stderr()[-3000:]
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{server.stderr()[-3000:]}"
        time.sleep(0.02)


def _spans_of(stdout: str, request_id: str) -> list[dict[str, object]]:
    spans = []
    for line in stdout.splitlines():
        try:
            span = json.loads(line)
        except ValueError:
            continue
        if isinstance(span, dict) and (span.get("attributes") or {}).get("request.id") == request_id:
            spans.append(span)
    return spans


@pytest.mark.parametrize(
    ("grace", "signals", "code"),
    [
        ("none", (signal.SIGTERM, signal.SIGTERM), 0),
        ("long", (signal.SIGTERM, signal.SIGTERM), 0),
        ("long", (signal.SIGINT,), 130),  # Ctrl-C: no drain, the same bound
    ],
    ids=["no-limit-second-sigterm", "long-grace-second-sigterm", "long-grace-ctrl-c"],
)
def test_a_second_signal_ends_the_process_in_seconds_with_a_batch_held_on_the_device(
    tmp_path: Path, grace: str, signals: tuple[signal.Signals, ...], code: int
) -> None:
    server = _spawn(tmp_path, grace)
    try:
        server.wait_ready()
        with ThreadPoolExecutor(1) as pool:
            answer = predict_in_background(pool, server.url, "held", STEP_TIMEOUT_S)
            _wait_for(server, "batch held on the device thread")
            *first, last = signals
            for signum in first:
                server.process.send_signal(signum)
                _wait_for(server, f"{signum.name}: draining before shutdown")
                time.sleep(0.5)  # the drain waits for the held batch
                assert server.process.poll() is None and not answer.done(), "the drain did not wait for the batch"
            server.process.send_signal(last)
            try:
                returncode = server.process.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {KILL_AFTER_S:.0f}s after the last signal:\n{server.stderr()[-3000:]}")
            response = answer.result(timeout=STEP_TIMEOUT_S)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=10)
    stderr = server.stderr()
    assert returncode == code, (returncode, stderr[-3000:])
    assert response.status_code == 503 and response.json()["code"] == "draining", response.text
    assert response.json()["request_id"] == "held"
    assert "abandoned" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    # telemetry flushed on the way out: the held request's server span, answered 503
    spans = _spans_of((tmp_path / "stdout.log").read_text(errors="replace"), "held")
    statuses = [
        attributes.get("http.response.status_code", attributes.get("http.status_code"))
        for span in spans
        if span.get("kind") == "SpanKind.SERVER" and isinstance(attributes := span.get("attributes"), dict)
    ]
    assert statuses == [503], f"the held request's server span, flushed, says 503: {spans}"
