"""``ai-backend floor``: the service behind the least HTTP possible, a reference for the ratio's ladder."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.bench.floor import FloorProtocol
from app.service import InferenceService
from tests.conftest import SettingsFactory
from tests.support import REPO_ROOT, b64, sample_png, server_environment


@pytest.fixture
async def floor(make_settings: SettingsFactory) -> AsyncIterator[str]:
    service = InferenceService(make_settings(batching={"normal": {"window_ms": 5.0, "max_batch": 4}}))
    await service.start()
    tasks: set[asyncio.Task[None]] = set()
    server = await asyncio.get_running_loop().create_server(lambda: FloorProtocol(service, tasks), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await service.close(1.0)


async def test_a_prediction_comes_back_with_its_label_and_batch_and_the_connection_serves_on(floor: str) -> None:
    async with httpx.AsyncClient(base_url=floor, timeout=30) as client:
        ready = await client.get("/readyz")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        answers = await asyncio.gather(
            *(client.post("/predict", json={"image_base64": b64(sample_png(d))}) for d in (3, 7, 3, 7))
        )
        assert [a.status_code for a in answers] == [200] * 4
        assert [a.json()["label"] for a in answers] == ["3", "7", "3", "7"]
        assert all(1 <= a.json()["batch_size"] <= 4 and a.json()["lane"] == "normal" for a in answers)


async def test_a_body_it_cannot_serve_closes_its_connection_and_the_next_one_is_served(floor: str) -> None:
    async with httpx.AsyncClient(base_url=floor, timeout=30) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/predict", content=b"{not json", headers={"content-type": "application/json"})
        answer = await client.post("/predict", json={"image_base64": b64(sample_png(5))})
        assert answer.status_code == 200 and answer.json()["label"] == "5"


def test_only_a_loopback_address_is_accepted() -> None:
    command = [sys.executable, "-m", "app.cli", "floor", "--host", "0.0.0.0"]
    result = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "loopback" in result.stderr


def test_the_command_serves_on_its_event_loop_and_stops_on_sigterm(tmp_path: Path) -> None:
    env = server_environment({"AI_SERVICE_MODEL__WARMUP": "false"})
    command = [sys.executable, "-m", "app.cli", "floor", "--port", "0"]  # any free port: it says which
    log = tmp_path / "floor.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (listening := re.search(r"listening on (http://127\.0\.0\.1:[1-9]\d*)\n", log.read_text())):
            assert process.poll() is None, log.read_text()  # the port opens once the service is ready
            assert time.monotonic() < deadline, "never listened"
            time.sleep(0.05)
        with httpx.Client(base_url=listening[1], timeout=30) as client:
            assert client.get("/readyz").status_code == 200
            answer = client.post("/predict", json={"image_base64": b64(sample_png(8))})
            assert answer.status_code == 200 and answer.json()["label"] == "8"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_a_body_past_the_services_limit_is_not_kept(make_settings: SettingsFactory) -> None:
    service = InferenceService(make_settings(server={"max_image_bytes": 1024}))
    protocol = FloorProtocol(service, set())
    closed: list[bool] = []

    class Transport:
        def is_closing(self) -> bool:
            return bool(closed)

        def close(self) -> None:
            closed.append(True)

    protocol.connection_made(Transport())  # type: ignore[arg-type]
    head = b"POST /predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 9000\r\n\r\n"
    protocol.data_received(head + b"x" * 8000)
    limit = service.settings.server.max_body_bytes  # the JSON body of the largest image allowed
    assert closed and protocol.body_bytes > limit and sum(map(len, protocol.body)) <= limit
