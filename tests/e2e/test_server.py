"""The real server as a subprocess on a loopback port, spoken to over HTTP.

One server (module scope) answers the serving tests; the start-up failures run their own
short-lived processes. Every process is stopped in ``finally`` (SIGTERM, then SIGKILL)
and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import START_TIMEOUT_S, ServerProcess, spawn
from tests.support import (
    DIGITS_DIR,
    MODEL_NAME,
    b64,
    copy_repository,
    png_from_array,
    sample_png,
    server_environment,
    top_label,
    truncate_file,
)

pytestmark = pytest.mark.e2e

EXIT_TIMEOUT_S = 60.0


@dataclass
class Server(ServerProcess):
    readiness: list[int | str] = field(default_factory=list)  # what each /readyz poll saw


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _poll_until_ready(server: Server) -> None:
    """Poll /readyz as fast as it answers, noting each status, until 200 (bounded)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(base_url=server.url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                pytest.fail(f"server exited with {server.process.returncode}:\n{server.stderr()[-4000:]}")
            try:
                status = client.get("/readyz").status_code
            except httpx.TransportError:  # not listening yet
                server.readiness.append("down")
                time.sleep(0.01)
                continue
            server.readiness.append(status)
            if status == 200:
                return
            time.sleep(0.002)
    pytest.fail(f"not ready after {START_TIMEOUT_S:.0f}s; saw {server.readiness[-20:]}:\n{server.stderr()[-4000:]}")


@dataclass(frozen=True)
class HeldOut:
    pngs: list[bytes]
    labels: list[str]


def _load_held_out() -> HeldOut:
    from app.training.digits import load_split

    split = load_split(seed=0)
    return HeldOut(
        [png_from_array(image) for image in split.heldout_images],
        [str(int(label)) for label in split.heldout_labels],
    )


@pytest.fixture(scope="module")
def held_out() -> Iterator[Future[HeldOut]]:
    """The held-out split as PNGs, prepared in a thread while the server starts (importing
    scikit-learn takes seconds)."""
    with ThreadPoolExecutor(1, thread_name_prefix="held-out") as pool:
        yield pool.submit(_load_held_out)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, held_out: Future[HeldOut]) -> Iterator[Server]:
    """The serving process. It asks for ``held_out`` only so that loading the split overlaps its start."""
    # Eager heads and a large warm-up batch make loading take long enough that /readyz
    # is sure to answer 503 between the socket opening and the models being ready.
    env = server_environment(
        {
            "AI_SERVICE_MODEL__EAGER_HEADS": "true",
            "AI_SERVICE_BATCHING__NORMAL__MAX_BATCH": "256",
            "AI_SERVICE_BATCHING__NORMAL__MAX_QUEUE": "1024",
        }
    )
    logs = tmp_path_factory.mktemp("server")
    process = spawn(logs, env)
    running = Server(process, logs)
    try:
        _poll_until_ready(running)
        yield running
    finally:
        _stop(process)


def test_readiness_is_503_until_the_models_are_ready(server: Server) -> None:
    seen = [s for s in server.readiness if s != "down"]
    assert seen[-1] == 200
    assert 503 in seen, f"never saw 503 before 200: {server.readiness}"
    assert seen.index(503) < seen.index(200)
    assert set(seen) <= {503, 200}, seen
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/livez").json() == {"status": "alive"}
        health = client.get("/healthz")
        assert health.status_code == 200 and health.json()["state"] == "ready"
        models = client.get("/v1/models").json()
        assert models["default"] == MODEL_NAME
        assert models["models"][0]["heads_loaded"] == ["classifier"]  # AI_SERVICE_MODEL__EAGER_HEADS


def test_bundled_samples_are_classified_right(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for digit in range(10):
            png = sample_png(digit)
            raw = client.post(
                "/predict", content=png, headers={"Content-Type": "image/png", "X-Request-ID": f"s{digit}"}
            )
            assert raw.status_code == 200, raw.text
            assert top_label(raw.json()) == str(digit)
            assert raw.json()["request_id"] == raw.headers["x-request-id"] == f"s{digit}"
            as_json = client.post(f"/v1/models/{MODEL_NAME}/predict", json={"image_base64": b64(png), "top_k": 2})
            assert as_json.status_code == 200, as_json.text
            assert top_label(as_json.json()) == str(digit) and len(as_json.json()["predictions"]) == 2


def test_held_out_accuracy_over_http(server: Server, held_out: Future[HeldOut]) -> None:
    manifest = json.loads((DIGITS_DIR / "1" / "manifest.json").read_text())
    expected = manifest["evaluation"]["accuracy"]["fp32"]
    images, labels = held_out.result(timeout=120).pngs, held_out.result().labels
    assert len(images) == manifest["evaluation"]["samples"]

    async def classify_all() -> list[httpx.Response]:
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

            async def one(png: bytes) -> httpx.Response:
                async with limit:
                    return await client.post("/predict", content=png, headers={"Content-Type": "image/png"})

            return await asyncio.gather(*(one(png) for png in images))

    responses = asyncio.run(classify_all())
    assert all(r.status_code == 200 for r in responses), next(r.text for r in responses if r.status_code != 200)
    correct = sum(top_label(r.json()) == label for r, label in zip(responses, labels, strict=True))
    accuracy = correct / len(labels)
    assert accuracy >= expected - 0.01, f"held-out accuracy over HTTP {accuracy:.4f}, manifest says {expected:.4f}"
    # concurrency reached the batcher, and every request kept an id of its own
    assert max(r.json()["batch_size"] for r in responses) > 1
    ids = [r.headers["x-request-id"] for r in responses]
    assert len(set(ids)) == len(ids)
    assert [r.json()["request_id"] for r in responses] == ids


def test_errors_over_http_keep_the_envelope(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        too_big = client.post(
            "/predict", content=b"\0" * (2 << 20), headers={"Content-Type": "image/png", "X-Request-ID": "big"}
        )
        assert too_big.status_code == 413
        assert too_big.json()["request_id"] == "big" and too_big.headers["x-request-id"] == "big"
        bad = client.post("/predict", content=b"{", headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_json"
        assert client.get("/v1/models/..%2F..%2Fetc").status_code == 404
        ok = client.post("/predict", content=sample_png(6), headers={"Content-Type": "image/png"})
        assert ok.status_code == 200 and top_label(ok.json()) == "6"
        # no WebSocket endpoints: a handshake is an HTTP request like any other (it was uvicorn's
        # plain-text 403, with no id, metrics or access line)
        handshake = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}
        handshake |= {"Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "X-Request-ID": "ws"}
        socket_upgrade = client.get("/predict", headers=handshake)
        assert socket_upgrade.status_code == 405 and socket_upgrade.json()["request_id"] == "ws"
        assert client.get("/healthz", headers=handshake).status_code == 200


def test_sigterm_stops_the_server_cleanly(server: Server) -> None:
    """Last in this module: it ends the shared server.

    uvicorn re-raises the SIGTERM it caught once shutdown is complete, so the process ends
    by that signal (status 143 in a shell) rather than with 0; either is a clean stop.
    """
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=EXIT_TIMEOUT_S)
    assert code in (0, -signal.SIGTERM), server.stderr()[-4000:]
    assert "Application shutdown complete" in server.stderr()
    assert '"level": "ERROR"' not in server.stderr() and '"level": "CRITICAL"' not in server.stderr()


@dataclass
class Doomed:
    """A server started with a fatal problem; it is expected to exit on its own."""

    process: subprocess.Popen[bytes]
    logs: Path
    broken: Path | None = None  # the file it should name

    def outcome(self) -> tuple[int, str]:
        """Its exit code and its stderr (bounded wait)."""
        try:
            code = self.process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(self.process)
            pytest.fail(f"the server did not exit within {EXIT_TIMEOUT_S:.0f}s:\n{self._stderr()[-4000:]}")
        return code, self._stderr()

    def _stderr(self) -> str:
        return (self.logs / "stderr.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def doomed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Doomed]]:
    """The start-up failure cases, started together (each spends seconds importing torch)
    once the serving process is done with (it is stopped by the test before these)."""
    repo_dir = tmp_path_factory.mktemp("corrupt")
    root = copy_repository(repo_dir)
    broken = root / MODEL_NAME / "1" / "backbone.safetensors"
    truncate_file(broken)
    cases = {
        "corrupt_repository": (server_environment({"AI_SERVICE_MODEL__REPOSITORY": str(root)}), broken),
        "invalid_setting": (server_environment({"AI_SERVICE_BATCHING__NORMAL__WINDOW_MS": "0"}), None),
    }
    started: dict[str, Doomed] = {}
    try:
        for name, (env, names) in cases.items():
            logs = tmp_path_factory.mktemp(name)
            started[name] = Doomed(spawn(logs, env), logs, names)
        yield started
    finally:
        for case in started.values():
            _stop(case.process)


def test_corrupt_repository_exits_non_zero_naming_the_file(doomed: dict[str, Doomed]) -> None:
    case = doomed["corrupt_repository"]
    code, stderr = case.outcome()
    assert code != 0, stderr[-4000:]
    assert f"start-up failed: {case.broken}" in stderr, stderr[-4000:]  # a JSON record, the default log
    assert "sha256 mismatch" in stderr


def test_invalid_setting_exits_2_naming_the_variable(doomed: dict[str, Doomed]) -> None:
    code, stderr = doomed["invalid_setting"].outcome()
    assert code == 2, stderr[-4000:]
    assert "AI_SERVICE_BATCHING__NORMAL__WINDOW_MS" in stderr, stderr[-4000:]
    assert "batching.normal.window_ms" in stderr
