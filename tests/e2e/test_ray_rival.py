"""The Ray Serve rival (``python -m app.bench.rivals ray``) as ``scripts/bench_alternate.sh`` runs it:
a subprocess on a free loopback port, its own local Ray under it, ready once ``/readyz`` answers
200; then the ten digit samples at once, each answered its own digit; then SIGTERM, after which it
must exit 0 and leave none of its processes (Ray's GCS, raylet, workers, Serve's proxy) running.

Every wait is bounded; only 127.0.0.1 is spoken to.
"""

from __future__ import annotations

import asyncio
import base64
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

from tests.support import MODELS_DIR, REPO_ROOT, free_port, sample_png, server_environment

pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

HOST = "127.0.0.1"
MAX_BATCH = 4
READY_TIMEOUT_S = 240.0  # Ray's own start, then a replica importing torch, on a busy 2-core machine
EXIT_TIMEOUT_S = 90.0  # Serve's and Ray's shutdown, then the rival's own grace for what is left
GONE_TIMEOUT_S = 3.0  # for the kernel to finish with processes killed as the rival exited

Process = tuple[int, str]  # a pid and its start time (so that a reused pid is not taken for it)


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (state first), or None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def descendants(pid: int) -> set[Process]:
    children: dict[int, list[Process]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found: set[Process] = set()
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.add(child)
            pending.append(child[0])
    return found


def running(processes: set[Process]) -> set[Process]:
    """Those of ``processes`` that still run (a zombie has ended)."""
    return {
        (pid, started)
        for pid, started in processes
        if (fields := _stat(pid)) is not None and fields[19] == started and fields[0] != "Z"
    }


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class Rival:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    tree: set[Process]  # its descendants once ready

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def wait_ready(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen: list[int | str] = []
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"the rival exited with {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
            try:
                status = client.get("/readyz").status_code
            except httpx.TransportError as exc:
                seen.append(type(exc).__name__)
            else:
                if status == 200:
                    return
                seen.append(status)
            time.sleep(0.2)
    pytest.fail(f"not ready after {READY_TIMEOUT_S:.0f}s; saw {seen[-10:]}:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.fixture
def rival(tmp_path: Path) -> Iterator[Rival]:
    port = free_port(HOST)
    log = tmp_path / "rival.log"
    command = [
        sys.executable,
        "-m",
        "app.bench.rivals",
        "ray",
        "--repository",
        str(MODELS_DIR),
        "--model",
        "digits",
        "--max-batch",
        str(MAX_BATCH),
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=server_environment(drop=("RAY_ADDRESS",)), stdout=out, stderr=out
        )
    tree: set[Process] = set()
    try:
        url = f"http://{HOST}:{port}"
        wait_ready(process, url, log)
        tree = descendants(process.pid)
        yield Rival(process, url, log, tree)
    finally:
        if process.poll() is None:  # the test failed before its SIGTERM: leave nothing behind
            tree |= descendants(process.pid)
            process.kill()
            process.wait(timeout=10)
        for pid, _ in running(tree):
            os.kill(pid, signal.SIGKILL)


async def _classify_all(url: str) -> list[httpx.Response]:
    """The ten digits' samples, sent at once (each as JSON, the image in base64)."""
    bodies = [{"image_base64": base64.b64encode(sample_png(d)).decode(), "top_k": 3} for d in range(10)]
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        return await asyncio.wait_for(asyncio.gather(*(client.post("/predict", json=b) for b in bodies)), 120.0)


def test_the_ray_rival_answers_every_digit_and_leaves_nothing_behind(rival: Rival) -> None:
    commands = [command_line(pid) for pid, _ in rival.tree]
    for part in ("gcs_server", "raylet", "ServeReplica", "ProxyActor"):
        assert any(part in c for c in commands), f"no {part} under the rival's pid: {commands}"

    for digit, response in enumerate(asyncio.run(_classify_all(rival.url))):
        assert response.status_code == 200, (digit, response.text)
        answer = response.json()
        assert answer["predictions"][0]["class_index"] == digit, (digit, answer)
        assert answer["predictions"][0]["label"] == str(digit), (digit, answer)
        assert len(answer["predictions"]) == 3
        assert 1 <= answer["batch_size"] <= MAX_BATCH, answer

    tree = rival.tree | descendants(rival.process.pid)
    rival.process.send_signal(signal.SIGTERM)
    try:
        code = rival.process.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {EXIT_TIMEOUT_S:.0f}s after SIGTERM:\n{rival.output()}")
    assert code == 0, rival.output()
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while (left := running(tree)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running: {[command_line(pid) for pid, _ in left]}\n{rival.output()}"
