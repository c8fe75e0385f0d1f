"""SIGHUP means "re-read the config file": before the app handles it (start-up), and after
(exit), it must not kill the server."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import spawn_digits

pytestmark = pytest.mark.e2e
DIGIT = (Path(__file__).parents[2] / "models" / "digits" / "samples" / "digit_7.png").read_bytes()


def test_a_sighup_while_the_server_starts_or_exits_does_not_kill_it(tmp_path: Path) -> None:
    # the reload handler lives in the lifespan; before it (settings read, torch imported, the
    # socket bound) and after it, SIGHUP kept its default action and ended the process: a config
    # tool that edits the file and signals a server that is just (re)starting killed it
    server = spawn_digits(tmp_path)
    process = server.process
    try:
        time.sleep(1.0)  # importing torch
        process.send_signal(signal.SIGHUP)
        server.wait_ready()  # fails with its log if the SIGHUP ended it
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGHUP)  # while it drains and exits
        assert process.wait(timeout=60) == 0, server.stderr()[-3000:]
    finally:
        server.stop()


def _signal_set(pid: int, field: str, signum: int) -> bool:
    """Whether ``/proc/<pid>/status`` shows ``signum`` in ``field`` (``SigIgn``: ignored,
    ``SigCgt``: caught by a handler)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to see the dispositions set")
def test_a_sighup_as_soon_as_serve_starts_is_ignored(tmp_path: Path) -> None:
    # SIGHUP was ignored only once the settings module was imported (pydantic: a third of a
    # second, more on a busy machine), after SIGTERM's handler: a SIGHUP in between ended the
    # process (exit -1, 129 in a shell) before it had said a word
    server = spawn_digits(tmp_path)
    process = server.process
    try:
        deadline = time.monotonic() + 30
        # the first disposition serve sets, whichever it is: start-up has begun
        while not (
            _signal_set(process.pid, "SigIgn", signal.SIGHUP) or _signal_set(process.pid, "SigCgt", signal.SIGTERM)
        ):
            assert process.poll() is None and time.monotonic() < deadline, "serve never set a disposition"
            time.sleep(0.005)
        process.send_signal(signal.SIGHUP)
        server.wait_ready()  # /readyz 200; fails with its log (and exit code) if the SIGHUP ended it
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, server.stderr()[-3000:]
    finally:
        server.stop()


def test_a_sighup_rereads_the_admin_token_and_the_api_key_from_their_files(tmp_path: Path) -> None:
    # a rotated Secret (Kubernetes rewrites the mounted file) took a restart: the token was read once
    token_file, key_file = tmp_path / "admin-token", tmp_path / "api-key"
    token_file.write_text("old-admin-token-0123456789")
    key_file.write_text("old-api-key-0123456789")
    env = {
        "AI_SERVICE_ADMIN__ENABLED": "true",
        "AI_SERVICE_ADMIN__TOKEN_FILE": str(token_file),
        "AI_SERVICE_SERVER__API_KEY_FILE": str(key_file),
    }
    server = spawn_digits(tmp_path, env)
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=10.0) as client:

            def statuses(token: str, key: str) -> tuple[int, int]:
                admin = client.get("/admin/policy", headers={"Authorization": f"Bearer {token}"})
                headers = {"Authorization": f"Bearer {key}", "Content-Type": "image/png"}
                predicted = client.post("/predict", content=DIGIT, headers=headers)
                return admin.status_code, predicted.status_code

            assert statuses("old-admin-token-0123456789", "old-api-key-0123456789") == (200, 200)
            token_file.write_text("new-admin-token-0123456789")
            key_file.write_text("new-api-key-0123456789")
            server.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while statuses("new-admin-token-0123456789", "new-api-key-0123456789") != (200, 200):
                assert time.monotonic() < deadline, server.stderr()[-3000:]
                time.sleep(0.05)
            assert statuses("old-admin-token-0123456789", "old-api-key-0123456789") == (403, 403)
            token_file.write_text("short")  # unusable: the secret in use stays
            server.process.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert statuses("new-admin-token-0123456789", "new-api-key-0123456789") == (200, 200)
            assert "that secret stays as it was" in server.stderr()
    finally:
        server.stop()
