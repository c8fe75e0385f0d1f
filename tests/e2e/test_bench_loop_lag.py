"""``ai-backend bench --server-metrics`` against the real server: its event loop's lag over the
measured window comes from the server's own ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import spawn_digits
from tests.support import REPO_ROOT, server_environment

pytestmark = pytest.mark.e2e


def _bench(url: str, out: Path, *extra: str) -> dict[str, object]:
    command = [sys.executable, "-m", "app.cli", "bench", "--url", url, "--concurrency", "4", "--duration", "1.5"]
    run = subprocess.run(
        [*command, "--warmup", "0.3", "--out", str(out), *extra],
        check=False,
        cwd=REPO_ROOT,
        env=server_environment({"PYTHONPATH": str(REPO_ROOT)}),
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    report: dict[str, object] = json.loads(out.read_text())
    return report


def test_the_report_carries_the_loop_lag_the_server_sampled_in_the_window(tmp_path: Path) -> None:
    server = spawn_digits(tmp_path, {"AI_SERVICE_TELEMETRY__LOOP_LAG_INTERVAL_MS": "20"})
    try:
        server.wait_ready()
        report = _bench(server.url, tmp_path / "with.json", "--server-metrics")
        plain = _bench(server.url, tmp_path / "without.json")
    finally:
        server.stop()
    lag = report["server_loop_lag"]
    assert isinstance(lag, dict) and lag["samples"] >= 1, lag
    assert lag["mean_ms"] >= 0 and lag["over_250ms"] <= lag["samples"]
    assert "server_loop_lag" not in plain  # only when asked: another server may have no /metrics
