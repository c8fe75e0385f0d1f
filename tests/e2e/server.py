"""The real server as a subprocess on a loopback port, for the end-to-end tests."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import REPO_ROOT, copy_repository, sample_png, server_environment

HOST = "127.0.0.1"
START_TIMEOUT_S = 90.0  # importing torch on a busy 2-core machine is slow


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    logs: Path  # holds stdout.log and stderr.log

    @functools.cached_property
    def port(self) -> int:
        """The port it bound (it is started on port 0, any free one), as its start-up log says;
        waits for that line (bounded), failing with the log if the process ends first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while (port := self._logged_port()) is None:
            if self.process.poll() is not None:
                pytest.fail(f"server exited with {self.process.returncode}:\n{self.stderr()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"not listening after {START_TIMEOUT_S:.0f}s:\n{self.stderr()[-4000:]}")
            time.sleep(0.02)
        return port

    def _logged_port(self) -> int | None:
        """The port in its "listening on" line (``app.server``'s JSON), once written."""
        for line in self.stderr().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # not a log record (a traceback), or a line still being written
                continue
            if isinstance(record, dict) and record.get("logger") == "app.server" and "port" in record:
                return int(record["port"])
        return None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stderr(self) -> str:
        return (self.logs / "stderr.log").read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, a bounded wait for its exit (then SIGKILL); its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode

    def wait_ready(self) -> None:
        """Poll /readyz until 200 (bounded); fail with the log if the process dies or never gets there."""
        deadline = time.monotonic() + START_TIMEOUT_S
        seen: list[int | str] = []
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    pytest.fail(f"server exited with {self.process.returncode}:\n{self.stderr()[-4000:]}")
                try:
                    status = client.get("/readyz").status_code
                except httpx.TransportError as exc:
                    seen.append(type(exc).__name__)
                    time.sleep(0.02)
                    continue
                if status == 200:
                    return
                seen.append(status)
                time.sleep(0.02)
        pytest.fail(f"not ready after {START_TIMEOUT_S:.0f}s; saw {seen[-20:]}:\n{self.stderr()[-4000:]}")


def spawn(logs: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m app.cli serve`` on loopback port 0, output to files (a full pipe would stall it).

    The server binds a free port itself and logs which (``ServerProcess.port``): a port picked
    free here and bound by the server later could be taken in between.
    """
    command = [sys.executable, "-m", "app.cli", "serve", "--host", HOST, "--port", "0"]
    with (logs / "stdout.log").open("wb") as out, (logs / "stderr.log").open("wb") as err:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=err)


def spawn_digits(tmp_path: Path, env: dict[str, str] | None = None) -> ServerProcess:
    """``spawn`` on a copy of the bundled digits repository, its warm-up off (start-up is what
    these tests watch), with ``env`` over the test environment."""
    base = {
        "PYTHONPATH": str(REPO_ROOT),
        "AI_SERVICE_MODEL__REPOSITORY": str(copy_repository(tmp_path)),
        "AI_SERVICE_MODEL__WARMUP": "false",
    }
    return ServerProcess(spawn(tmp_path, server_environment(base | (env or {}))), tmp_path)


def catches(pid: int, signum: int) -> bool:
    """The process has a handler of its own for ``signum`` (``SigCgt`` in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


def signalled_as_it_starts(signum: int, timeout_s: float = 120.0) -> tuple[int, str]:
    """``serve`` sent ``signum`` once start-up has begun (its handlers for SIGTERM and ``signum``
    set, before torch's seconds-long import): its exit code and its stderr."""
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
        while not (catches(process.pid, signal.SIGTERM) and catches(process.pid, signum)):  # start-up has begun
            assert process.poll() is None and time.monotonic() < deadline, "serve never set its handler"
            time.sleep(0.005)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    return process.returncode, stderr


def predict_in_background(pool: Executor, url: str, request_id: str, timeout_s: float) -> Future[httpx.Response]:
    """A PNG prediction with ``request_id`` sent on ``pool``'s thread: the test goes on (signals the
    server, say) while it waits for its answer."""
    headers = {"Content-Type": "image/png", "X-Request-ID": request_id}
    return pool.submit(httpx.post, f"{url}/predict", content=sample_png(7), headers=headers, timeout=timeout_s)
