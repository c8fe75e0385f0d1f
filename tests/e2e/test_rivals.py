"""The rivals (``python -m app.bench.rivals``) as ``scripts/bench_alternate.sh`` runs them: a real
process on a loopback port serving the bundled digits model, read right, batching where the rival
batches, and gone on SIGTERM with every process it started.

The side-by-side figures mean something only if each rival serves the same model the same way
(the same answers) and the harness can start, measure and stop it cleanly. The port is picked
free and handed over (neither LitServe nor uvicorn's ``run`` reports a port chosen from 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.bench.processes import descendants
from tests.support import LABELS, MODELS_DIR, REPO_ROOT, b64, free_port, sample_png, server_environment

pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"
READY_TIMEOUT_S = 120.0  # LitServe spawns a worker that imports torch and loads the model
EXIT_TIMEOUT_S = 60.0


@dataclass
class Rival:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def start_rival(name: str, ready_path: str, extra: list[str], log: Path) -> Rival:
    """The rival serving on a free port, ready; started again on another port, once, when the
    one it was given was taken before it could bind it."""
    try:
        return _start_rival(name, ready_path, extra, log)
    except PortTaken:
        return _start_rival(name, ready_path, extra, log)


class PortTaken(Exception):
    """The rival exited because its port was taken between ``free_port`` and its bind."""


def _start_rival(name: str, ready_path: str, extra: list[str], log: Path) -> Rival:
    port = free_port()
    command = [sys.executable, "-m", "app.bench.rivals", name, "--repository", str(MODELS_DIR), "--model", "digits"]
    command += ["--max-batch", "4", "--port", str(port), *extra]
    with log.open("wb") as out:
        env = server_environment()
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    rival = Rival(process, f"http://{HOST}:{port}", log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            if "address already in use" in rival.output().lower():
                with contextlib.suppress(ProcessLookupError):  # what it started, if it started anything
                    os.killpg(process.pid, signal.SIGKILL)
                raise PortTaken(port)
            pytest.fail(f"{name} exited with {process.returncode}:\n{rival.output()}")
        try:
            if httpx.get(rival.url + ready_path, timeout=2).status_code == 200:
                return rival
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{name} not ready after {READY_TIMEOUT_S:.0f}s:\n{rival.output()}")
        time.sleep(0.2)


async def classify_all(url: str) -> list[dict[str, object]]:
    """The ten sample digits at once, as ``ai-backend bench`` sends them (JSON, base64)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answers = await asyncio.gather(
            *(client.post("/predict", json={"image_base64": b64(sample_png(d)), "top_k": 3}) for d in range(10))
        )
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [answer.json() for answer in answers]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]


@pytest.fixture
def rival_log(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "rival.log"


@pytest.mark.parametrize(
    ("name", "ready_path", "extra", "batches"),
    [
        ("litserve", "/health", ["--workers", "1", "--batch-timeout", "0.05"], True),
        ("fastapi", "/readyz", [], False),
    ],
)
def test_a_rival_reads_the_digits_and_leaves_nothing_running_after_sigterm(
    name: str, ready_path: str, extra: list[str], batches: bool, rival_log: Path
) -> None:
    rival = start_rival(name, ready_path, extra, rival_log)
    try:
        answers = asyncio.run(classify_all(rival.url))
        for digit, answer in enumerate(answers):
            predictions = answer["predictions"]
            assert isinstance(predictions, list) and len(predictions) == 3
            assert predictions[0]["class_index"] == digit and predictions[0]["label"] == LABELS[digit]
            assert predictions[0]["probability"] > 0.5
        sizes = [answer["batch_size"] for answer in answers]
        assert all(isinstance(size, int) and 1 <= size <= 4 for size in sizes)
        if batches:  # ten requests at once, a 50 ms window: some ran together
            assert max(sizes) > 1, sizes
        else:
            assert set(sizes) == {1}
        started = [pid for pid, _ in descendants(rival.process.pid)]
        rival.process.send_signal(signal.SIGTERM)
        # uvicorn, once it has shut down, ends by the signal it caught (-15); LitServe's rival exits 0
        assert rival.process.wait(timeout=EXIT_TIMEOUT_S) in (0, -signal.SIGTERM), rival.output()
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while (left := [pid for pid in started if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"{name} left processes running after SIGTERM: {left}\n{rival.output()}"
    finally:  # whatever is left of its process group (it was started in a session of its own)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rival.process.pid, signal.SIGKILL)
        if rival.process.poll() is None:
            rival.process.wait(timeout=10)
