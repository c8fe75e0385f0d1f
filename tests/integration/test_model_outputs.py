"""Models unlike the bundled one: fewer classes than the default top_k, outputs that are not finite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from app.inference.manifest import InputSpec, Provenance
from app.inference.packaging import write_version
from app.service import State
from tests.conftest import SettingsFactory
from tests.support import b64, png_from_array, running_app, sample_png


def _three_classes(root: Path, backbone: nn.Module) -> None:
    torch.manual_seed(0)
    write_version(
        root,
        name="three",
        version="1",
        backbone=backbone,
        heads={"classifier": nn.Linear(4, 3)},
        input_spec=InputSpec(channels=1, height=8, width=8, mean=(0.5,), std=(0.5,)),
        labels=("a", "b", "c"),
        provenance=Provenance(source="tests"),
    )


async def test_a_model_of_fewer_classes_than_the_default_top_k_answers_requests_naming_none(
    tmp_path: Path, make_settings: SettingsFactory
) -> None:
    _three_classes(tmp_path / "models", nn.Sequential(nn.Flatten(), nn.Linear(64, 4)))
    async with running_app(make_settings(model={"repository": tmp_path / "models", "default": "three"})) as running:
        raw = await running.predict_png(sample_png(3))
        as_json = await running.client.post("/predict", json={"image_base64": b64(sample_png(3))})
        asked = await running.client.post("/predict", json={"image_base64": b64(sample_png(3)), "top_k": 4})
    assert raw.status_code == 200 and len(raw.json()["predictions"]) == 3, raw.text
    assert as_json.status_code == 200 and len(as_json.json()["predictions"]) == 3, as_json.text
    assert asked.status_code == 422 and "at most 3" in asked.json()["message"], "what a client asks is still checked"


class _PerImageMax(nn.Module):
    """Divides each image by its own largest value, as some models do: 0/0 for a black image."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x / x.abs().amax(dim=(1, 2, 3), keepdim=True)).flatten(1)


async def test_an_output_that_is_not_finite_is_not_an_answer(tmp_path: Path, make_settings: SettingsFactory) -> None:
    # mean 0 and std 1: a black image is all zeros after normalisation
    torch.manual_seed(0)
    write_version(
        tmp_path / "models",
        name="maxnorm",
        version="1",
        backbone=nn.Sequential(_PerImageMax(), nn.Linear(64, 4)),
        heads={"classifier": nn.Linear(4, 3)},
        input_spec=InputSpec(channels=1, height=8, width=8, mean=(0.0,), std=(1.0,)),
        labels=("a", "b", "c"),
        provenance=Provenance(source="tests"),
    )
    settings = make_settings(model={"repository": tmp_path / "models", "default": "maxnorm", "eager_heads": True})
    async with running_app(settings) as running:
        assert running.service.state is State.READY  # random dummy batches pass the self-check
        black = png_from_array(np.zeros((16, 16), dtype=np.uint8))
        answer = await running.client.post("/predict", json={"image_base64": b64(black), "top_k": 3})
        fine = await running.client.post("/predict", json={"image_base64": b64(sample_png(3)), "top_k": 3})
    assert answer.status_code == 500 and answer.json()["code"] == "internal_error", answer.text
    assert fine.status_code == 200 and all(isinstance(p["probability"], float) for p in fine.json()["predictions"])
