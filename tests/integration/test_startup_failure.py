"""A model repository that cannot be served stops start-up with a message naming the file."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from app.inference import loader
from app.inference.loader import LayeredModel, PreparedLayer
from app.inference.manifest import Layer, Manifest, Provenance
from app.inference.packaging import write_version
from app.main import StartupFailed
from app.service import State
from app.training.digits import make_backbone
from tests.conftest import SettingsFactory
from tests.support import (
    DIGITS_DIR,
    LABELS,
    MODEL_NAME,
    b64,
    copy_repository,
    running_app,
    sample_png,
    top_label,
    truncate_file,
)


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


async def test_an_empty_repository_says_what_a_model_folder_holds(
    tmp_path: Path, make_settings: SettingsFactory
) -> None:
    """Pointed at a folder with no model in it (a model's own folder, ``models/digits``, is the
    common slip), start-up said "has no model named any"."""
    calls: list[str] = []
    async with running_app(make_settings(model={"repository": DIGITS_DIR}), on_fatal=calls.append):
        assert len(calls) == 1, calls
        assert "has no model in it" in calls[0] and "<name>/<version>/manifest.json" in calls[0]


async def test_a_relative_repository_that_is_missing_is_named_with_where_it_was_looked_for(
    tmp_path: Path, make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.repository`` defaults to ``models``, relative to the working directory: started
    from another folder, the message said only "model repository models is not a directory"."""
    monkeypatch.chdir(tmp_path)
    calls: list[str] = []
    async with running_app(make_settings(model={"repository": Path("models")}), on_fatal=calls.append):
        assert len(calls) == 1, calls
        assert str(tmp_path / "models") in calls[0] and "working directory" in calls[0]


def _digits_with_a_head_of(root: Path, outputs: int) -> Path:
    """digits/1 whose manifest validates (10 labels, every sha256 right), with a head of
    ``outputs`` classes: only running it shows the mismatch."""
    torch.manual_seed(0)
    bundled = Manifest.read(DIGITS_DIR / "1")
    return write_version(
        root,
        name=MODEL_NAME,
        version="1",
        backbone=make_backbone(),
        heads={"classifier": nn.Linear(64, outputs)},
        input_spec=bundled.input,
        labels=LABELS,
        provenance=Provenance(source="tests"),
    )


async def test_a_head_that_does_not_match_the_labels_fails_start_up_with_the_warm_up(
    tmp_path: Path, make_settings: SettingsFactory
) -> None:
    # the warm-up loads the default head (every request uses it): its self-check runs at start
    _digits_with_a_head_of(tmp_path / "models", 9)
    calls: list[str] = []
    settings = make_settings(model={"repository": tmp_path / "models", "warmup": True})
    async with running_app(settings, on_fatal=calls.append) as running:
        assert running.service.state is State.FAILED
        assert len(calls) == 1 and "head classifier gives shape (2, 9), expected (2, 10)" in calls[0]
        assert (await running.client.get("/readyz")).status_code == 503


async def test_a_lazy_head_that_cannot_serve_is_503_and_never_loaded_again(
    tmp_path: Path, make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _digits_with_a_head_of(tmp_path / "models", 9)
    settings = make_settings(model={"repository": tmp_path / "models", "warmup": False})
    async with running_app(settings) as running:
        assert running.service.state is State.READY  # nothing ran the head yet
        with caplog.at_level(logging.ERROR):
            answers = [await running.predict_png(sample_png(d)) for d in (1, 2, 3)]
        assert [a.status_code for a in answers] == [503, 503, 503]
        assert {a.json()["code"] for a in answers} == {"model_unavailable"} and answers[0].headers["Retry-After"]
        assert "shape" not in answers[0].text, "the detail is in the log, not the answer"
    failed_loads = [r for r in caplog.records if "cannot serve" in r.getMessage()]
    assert len(failed_loads) == 1, "the head was loaded once, not once per request"


BUSY = "CUDA error: CUDA-capable device(s) is/are busy or unavailable"


async def test_a_device_that_fails_the_load_at_start_up_is_named_with_its_error_and_no_try_again_later(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fatal message said "the device failed (device error); try again later", the CUDA error
    only in a log line of its own: another start fails the same way."""
    load_layer = loader.load_layer

    def busy(folder: Path, manifest: Manifest, layer: Layer, *args: Any) -> PreparedLayer:
        if layer.name == manifest.backbone.name:
            raise torch.AcceleratorError(f"{BUSY}\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")
        return load_layer(folder, manifest, layer, *args)

    monkeypatch.setattr(loader, "load_layer", busy)
    calls: list[str] = []
    async with running_app(make_settings(), on_fatal=calls.append) as running:
        assert running.service.state is State.FAILED
    assert len(calls) == 1, calls
    assert f"{MODEL_NAME}/1" in calls[0] and BUSY in calls[0] and "the device failed" in calls[0]
    assert "try again" not in calls[0]


async def test_out_of_memory_in_the_start_up_warm_up_names_the_max_batch_to_lower(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_of_memory = "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
    warm_up = LayeredModel.warm_up

    def short_of_memory(
        model: LayeredModel, max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None
    ) -> None:
        if max(model.warm_up_sizes(max_batch) if sizes is None else sizes) >= 32:
            raise torch.cuda.OutOfMemoryError(out_of_memory)
        warm_up(model, max_batch, rounds, sizes)

    monkeypatch.setattr(LayeredModel, "warm_up", short_of_memory)
    lanes = {"normal": {"max_batch": 32}, "urgent": {"max_batch": 4}}
    calls: list[str] = []
    async with running_app(make_settings(model={"warmup": True}, batching=lanes), on_fatal=calls.append) as running:
        assert running.service.state is State.FAILED
    assert len(calls) == 1, calls
    (message,) = calls
    assert out_of_memory in message and "warm-up" in message and "try again" not in message
    assert "lower batching.normal.max_batch (AI_SERVICE_BATCHING__NORMAL__MAX_BATCH), now 32" in message
    assert "urgent" not in message, "its batches are smaller: not the setting to change"


async def test_a_cuda_device_this_machine_does_not_have_fails_the_app_s_start(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named through ``on_fatal`` once, and the start itself fails (a Ray replica must not come up
    serving nothing), with ``StartupFailed``: ``serve`` leaves uvicorn's traceback of it out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls: list[str] = []
    with pytest.raises(StartupFailed, match="model.device=cuda but CUDA is not available"):
        async with running_app(make_settings(model={"device": "cuda"}), on_fatal=calls.append):
            pass
    assert calls == ["model.device=cuda but CUDA is not available on this machine"]
