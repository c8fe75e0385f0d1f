"""The real server as a subprocess on a loopback port, for the end-to-end tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import REPO_ROOT, copy_repository, free_port, server_environment

HOST = "127.0.0.1"
START_TIMEOUT_S = 90.0  # importing torch on a busy 2-core machine is slow


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    logs: Path  # holds stdout.log and stderr.log

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


def spawn(logs: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """``python -m app.cli serve`` on a free loopback port, output to files (a full pipe would stall it)."""
    port = free_port(HOST)
    command = [sys.executable, "-m", "app.cli", "serve", "--host", HOST, "--port", str(port)]
    with (logs / "stdout.log").open("wb") as out, (logs / "stderr.log").open("wb") as err:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=err)
    return process, port


def spawn_digits(tmp_path: Path, env: dict[str, str] | None = None) -> ServerProcess:
    """``spawn`` on a copy of the bundled digits repository, its warm-up off (start-up is what
    these tests watch), with ``env`` over the test environment."""
    base = {
        "PYTHONPATH": str(REPO_ROOT),
        "AI_SERVICE_MODEL__REPOSITORY": str(copy_repository(tmp_path)),
        "AI_SERVICE_MODEL__WARMUP": "false",
    }
    process, port = spawn(tmp_path, server_environment(base | (env or {})))
    return ServerProcess(process, port, tmp_path)
