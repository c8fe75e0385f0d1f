"""``model.device=auto`` on a machine whose GPU CUDA reports but cannot be used (another process
holds it in exclusive mode, or its memory is full): the service serves from the CPU, and says why."""

from __future__ import annotations

import logging

import pytest
import torch

from app.service import State
from tests.conftest import SettingsFactory
from tests.support import running_app, sample_png, top_label
from tests.unit.test_device_resolution import BUSY, gpu_held_elsewhere


async def test_auto_with_a_gpu_held_elsewhere_starts_on_the_cpu_and_says_why(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``torch.cuda.is_available()`` makes no context: it passed, the model's first move to
    cuda:0 failed, and start-up died with "the device failed (device error); try again later"."""
    gpu_held_elsewhere(monkeypatch)
    calls: list[str] = []
    with caplog.at_level(logging.WARNING, logger="app.inference.device"):
        async with running_app(
            make_settings(model={"device": "auto", "dtype": "auto"}), on_fatal=calls.append
        ) as running:
            assert calls == [] and running.service.state is State.READY
            assert (running.service.device, running.service.dtype) == (torch.device("cpu"), torch.float32)
            answer = await running.predict_png(sample_png(4))
            assert answer.status_code == 200 and top_label(answer.json()) == "4"
    (said,) = [r.getMessage() for r in caplog.records if r.name == "app.inference.device"]
    assert BUSY in said and "serving from the CPU" in said
