"""The container's health check (``python -m app.healthcheck``) against the real server."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.server import HOST, spawn_digits
from tests.support import REPO_ROOT, server_environment


def _check(pid: int, temp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.healthcheck", "--pid", str(pid)],
        cwd=REPO_ROOT,
        env=server_environment({"TMPDIR": str(temp), **env}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_health_check_asks_where_the_server_listens_not_what_the_settings_say_now(tmp_path: Path) -> None:
    """It read the settings anew at every check: a ``server.port`` edited into the config file
    (which waits for a restart), or an edit the service refused and serves on through, turned a
    serving container unhealthy. The server now writes where it listens, and the check asks there."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    server = spawn_digits(tmp_path, {"TMPDIR": str(temp)})
    written = temp / f"ai-backend-{server.process.pid}.address"
    try:
        port = server.port
        deadline = time.monotonic() + 10
        while not written.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert written.read_text().split() == [HOST, str(port)]
        unreadable = tmp_path / "edited.toml"
        unreadable.write_text("[batching.normal]\nwindow_ms = \n")  # an edit the service refuses
        for settings in ({"AI_SERVICE_SERVER__PORT": "1"}, {"AI_SERVICE_CONFIG_FILE": str(unreadable)}):
            checked = _check(server.process.pid, temp, **settings)
            assert checked.returncode == 0, checked.stderr
    finally:
        assert server.stop() == 0, server.stderr()[-4000:]
    assert not written.exists(), "a stopped server's address is gone"
    gone = _check(server.process.pid, temp, AI_SERVICE_SERVER__PORT="1")  # the settings' port then
    assert gone.returncode == 1 and ":1/livez" in gone.stderr, gone.stderr
