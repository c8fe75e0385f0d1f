"""A model repository that cannot be served stops start-up with a message naming the file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from app.service import State
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, b64, copy_repository, running_app, sample_png, top_label, truncate_file


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _remove(path: Path) -> None:
    path.unlink()


BREAKAGES: list[tuple[str, str, Callable[[Path], None], bool]] = [
    # (id, file, how it breaks, eager heads)
    ("truncated-backbone-weights", "backbone.safetensors", truncate_file, False),
    ("flipped-backbone-graph", "backbone.graph.pt", _flip_middle_byte, False),
    ("missing-backbone-weights", "backbone.safetensors", _remove, False),
    ("truncated-head-weights-eager", "classifier.safetensors", truncate_file, True),
]


@pytest.mark.parametrize(("file", "breaks", "eager"), [b[1:] for b in BREAKAGES], ids=[b[0] for b in BREAKAGES])
async def test_corrupt_repository_fails_start_up(
    tmp_path: Path, make_settings: SettingsFactory, file: str, breaks: Callable[[Path], None], eager: bool
) -> None:
    root = copy_repository(tmp_path)
    breaks(root / MODEL_NAME / "1" / file)
    calls: list[str] = []
    settings = make_settings(model={"repository": root, "eager_heads": eager})
    async with running_app(settings, on_fatal=calls.append) as running:
        assert len(calls) == 1, calls
        assert file in calls[0]
        assert str(root / MODEL_NAME / "1") in calls[0]
        service = running.service
        assert service.state is State.FAILED
        assert service.failure is not None and file in service.failure

        ready = await running.client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["code"] == "not_ready" and "retry-after" in ready.headers

        health = await running.client.get("/healthz")
        assert health.status_code == 503
        report = health.json()
        assert report["status"] == "failing" and report["state"] == "failed"
        assert file in report["failure"]

        predict = await running.client.post("/predict", json={"image_base64": b64(sample_png(1))})
        assert predict.status_code == 503
        assert predict.json()["code"] == "model_not_ready"
        assert (await running.client.get("/livez")).status_code == 200


async def test_corrupt_lazy_head_fails_start_up(tmp_path: Path, make_settings: SettingsFactory) -> None:
    """DESIGN.md: "a corrupt or mismatched file fails start-up with a clear message"."""
    root = copy_repository(tmp_path)
    truncate_file(root / MODEL_NAME / "1" / "classifier.safetensors")
    calls: list[str] = []
    async with running_app(make_settings(model={"repository": root}), on_fatal=calls.append) as running:
        predict = await running.predict_png(sample_png(1))
        assert predict.status_code != 500, "a corrupt head was found only by a client's request"
        assert len(calls) == 1 and "classifier.safetensors" in calls[0]
        assert (await running.client.get("/readyz")).status_code == 503


async def test_intact_copy_starts(tmp_path: Path, make_settings: SettingsFactory) -> None:
    """The control for the cases above: the same copy, unbroken, serves."""
    calls: list[str] = []
    settings = make_settings(model={"repository": copy_repository(tmp_path)})
    async with running_app(settings, on_fatal=calls.append) as running:
        assert calls == [] and running.service.state is State.READY
        response = await running.predict_png(sample_png(8))
        assert response.status_code == 200 and top_label(response.json()) == "8"


async def test_empty_repository_fails_start_up(tmp_path: Path, make_settings: SettingsFactory) -> None:
    calls: list[str] = []
    (tmp_path / "empty").mkdir()
    async with running_app(make_settings(model={"repository": tmp_path / "empty"}), on_fatal=calls.append) as running:
        assert len(calls) == 1 and str(tmp_path / "empty") in calls[0]
        assert running.service.state is State.FAILED
        assert (await running.client.get("/readyz")).status_code == 503
