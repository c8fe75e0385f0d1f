"""What ``write_version`` writes to manifest.json: read back alike, and by a server built before
the input spec's ``background`` wherever the model does not need it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from app.inference.manifest import MANIFEST_FILE, InputSpec, Manifest, Provenance, ResizeSpec
from app.inference.packaging import write_version
from tests.support import DIGITS_DIR


class _InputSpecBeforeBackground(BaseModel):
    """InputSpec as a server built before 1731fbc reads it: no ``background``, nothing unknown taken."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    channels: Literal[1, 3]
    height: int = Field(ge=1, le=4096)
    width: int = Field(ge=1, le=4096)
    resize: ResizeSpec = ResizeSpec()
    mean: tuple[float, ...]
    std: tuple[float, ...]


def _written(root: Path, spec: InputSpec) -> tuple[Path, dict[str, object]]:
    folder = write_version(
        root,
        name="tiny",
        version="1",
        backbone=nn.Flatten(),
        heads={"classifier": nn.Linear(spec.channels * spec.height * spec.width, 2)},
        input_spec=spec,
        labels=("no", "yes"),
        provenance=Provenance(source="tests"),
    )
    raw = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert isinstance(raw["input"], dict)
    return folder, raw["input"]


def test_a_manifest_of_the_default_background_leaves_it_out_and_an_older_server_reads_it(tmp_path: Path) -> None:
    """Every manifest named ``background`` once it existed, black included: a server built before it
    refused them all (an unknown field), the bundled digits model and train-digits' output too,
    where replicas share a model volume across a rolling update or a rollback."""
    spec = Manifest.read(DIGITS_DIR / "1").input
    assert spec.background == "black"
    folder, written = _written(tmp_path, spec)
    assert "background" not in written
    _InputSpecBeforeBackground.model_validate(written)
    assert Manifest.read(folder).input == spec


@pytest.mark.parametrize("background", ["white", "drop"])
def test_a_manifest_of_another_background_names_it(tmp_path: Path, background: str) -> None:
    """A model that needs another background (an export's ``drop``) says so, and needs a server
    that knows the field: an older one refuses the manifest rather than serve it on black."""
    spec = Manifest.read(DIGITS_DIR / "1").input.model_copy(update={"background": background})
    folder, written = _written(tmp_path, spec)
    assert written["background"] == background
    assert Manifest.read(folder).input == spec
    with pytest.raises(ValueError, match="background"):
        _InputSpecBeforeBackground.model_validate(written)
