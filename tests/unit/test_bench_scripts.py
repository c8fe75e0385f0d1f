"""The bench scripts' failure paths: what they say when a step fails, and whose server they measure."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _fake_tree(tmp_path: Path, python_body: str) -> Path:
    """A copy of the bench scripts beside a stand-in ``.venv/bin/python`` (a shell script)."""
    import shutil
    import stat

    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("bench_ratio.sh", "bench_common.sh"):
        shutil.copy(SCRIPTS / name, tree / "scripts" / name)
    python = tree / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/usr/bin/env bash\n" + python_body)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tree


def test_bench_ratio_says_why_when_the_limit_fails(tmp_path: Path) -> None:

    tree = _fake_tree(
        tmp_path,
        'if [ "${1:-}" = - ]; then cat >/dev/null; exit 0; fi\n'  # wait_quiet
        'if [ "${2:-}" = app.bench.limit ]; then\n'
        "  echo \"ai-backend limit: model 'mobilenet_v3_small' is not in /repo (it holds: none)\" >&2; exit 1\n"
        "fi\nexit 0\n",
    )
    repo = tmp_path / "repo"
    (repo / "mobilenet_v3_small").mkdir(parents=True)
    env = {**os.environ, "REPOSITORY": str(repo), "QUIET_WAIT": "0"}
    done = subprocess.run(
        ["bash", str(tree / "scripts" / "bench_ratio.sh"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    # the run stops at step (ii); the one line that says why must reach the user
    assert "is not in /repo" in done.stderr + done.stdout, done.stderr


def test_wait_ready_does_not_take_another_process_on_the_port_for_a_server_that_died(tmp_path: Path) -> None:
    """A server that dies at start (its port taken by a stale server from an earlier run) is
    not ready: the bench would measure the other process."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    stale = HTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=stale.serve_forever, daemon=True).start()
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()  # our server: exited (address in use)
        script = (
            f'py=true; REPOSITORY="{tmp_path}/repository"; source "{SCRIPTS}/bench_common.sh"; trap - EXIT; '
            f"port={stale.server_address[1]}; "
            f'server_pid={dead.pid}; wait_ready "{tmp_path}/server.log"'
        )
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=90, check=False)
    finally:
        stale.shutdown()
        stale.server_close()
    assert done.returncode != 0, "wait_ready returned ready for a server that had exited"
    assert "server exited" in done.stderr
