"""``model.device``: ``auto`` takes the GPU only if it works; a device named that is not here is a
setting to change (``DeviceMissing``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from app.inference import device
from app.inference.device import resolve_device

BUSY = "CUDA error: CUDA-capable device(s) is/are busy or unavailable"


def gpu_held_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's ``is_available`` says yes (it makes no context), and the first tensor on the GPU
    fails, as with a GPU another process holds in exclusive mode."""
    ones = torch.ones

    def refused(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            raise torch.AcceleratorError(f"{BUSY}\nCUDA kernel errors might be asynchronously reported")
        return ones(*size, device=device, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "ones", refused)


def test_auto_serves_from_the_cpu_when_the_gpu_cannot_be_used_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpu_held_elsewhere(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="app.inference.device"):
        assert resolve_device("auto") == torch.device("cpu")
    (said,) = [r.getMessage() for r in caplog.records]
    assert "model.device=auto" in said and "cuda:0" in said and BUSY in said and "serving from the CPU" in said


def test_auto_on_a_machine_without_cuda_is_the_cpu_without_a_word(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert resolve_device("auto") == torch.device("cpu")
    assert caplog.records == []


def test_a_cuda_device_this_machine_does_not_have_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(device.DeviceMissing, match="model.device=cuda but CUDA is not available on this machine"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        device.DeviceMissing, match=r"model.device=cuda:1 but this machine has 1 CUDA device\(s\), cuda:0 to"
    ):
        resolve_device("cuda:1")
    assert resolve_device("cuda:0") == torch.device("cuda", 0), "named, it is not tried out: its load says"
    assert resolve_device("cpu") == torch.device("cpu")
