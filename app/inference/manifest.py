"""The manifest of one model version: what the files are and how an image becomes an input.

A manifest lives at ``models/<name>/<version>/manifest.json``. It is the only thing the
loader trusts about a version, and everything it says is checked: every file it names
has its sha256 recorded, and the layers name only files listed there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MANIFEST_FILE = "manifest.json"
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
# a whole number as written plainly: "01" beside "1" sorted alike, and which was latest depended
# on the order the file system listed them
VERSION_PATTERN = r"^(0|[1-9][0-9]{0,8})$"
_SHA256 = r"^[0-9a-f]{64}$"

Name = Annotated[str, Field(pattern=NAME_PATTERN)]
Version = Annotated[str, Field(pattern=VERSION_PATTERN)]
FileName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]


def is_valid_name(value: str) -> bool:
    """Whether ``value`` may name a model (and so a folder under the repository root)."""
    return re.fullmatch(NAME_PATTERN, value) is not None


def is_valid_version(value: str) -> bool:
    """Whether ``value`` may name a version folder."""
    return re.fullmatch(VERSION_PATTERN, value) is not None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResizeSpec(_Strict):
    """How a decoded image of any size maps onto the input grid.

    ``stretch`` resizes straight to height x width; ``shorter_side_then_center_crop``
    resizes the shorter side to ``resize_to`` and crops the centre, as ImageNet models expect;
    ``fit_content`` crops to the content (pixels brighter than ``content_threshold`` of the
    brightest), centres it in a square and resizes that, as the digits set was size-normalised.
    """

    mode: Literal["stretch", "shorter_side_then_center_crop", "fit_content"] = "stretch"
    filter: Literal["box", "bilinear", "bicubic", "nearest"] = "bilinear"
    resize_to: int | None = Field(default=None, ge=1, le=4096)
    content_threshold: float = Field(default=0.25, gt=0, lt=1)

    @model_validator(mode="after")
    def _crop_needs_size(self) -> ResizeSpec:
        if self.mode == "shorter_side_then_center_crop" and self.resize_to is None:
            raise ValueError("resize_to is required for shorter_side_then_center_crop")
        return self


class InputSpec(_Strict):
    """The model's input: a ``channels x height x width`` float tensor, ``(x / 255 - mean) / std``.

    ``background`` is what an image's transparent pixels become: composited onto ``black`` (the
    bundled digits model reads light digits on a dark ground) or ``white``, or ``drop``: the alpha
    is dropped and every pixel keeps its stored colour, as torchvision's reference loader
    (``img.convert("RGB")``) gives ImageNet models their input.
    """

    channels: Literal[1, 3]
    height: int = Field(ge=1, le=4096)
    width: int = Field(ge=1, le=4096)
    resize: ResizeSpec = ResizeSpec()
    mean: tuple[float, ...]
    std: tuple[float, ...]
    background: Literal["black", "white", "drop"] = "black"

    @model_validator(mode="after")
    def _per_channel(self) -> InputSpec:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError("mean and std need one value per channel")
        if any(s <= 0 for s in self.std):
            raise ValueError("std values must be > 0")
        return self


class Layer(_Strict):
    """One separately stored piece of the model: a TorchScript graph and its weights."""

    name: Name
    role: Literal["backbone", "head"]
    graph: FileName
    weights: FileName


class Evaluation(_Strict):
    """Held-out accuracy, per precision the version was evaluated in (``fp32``, ``fp16``)."""

    dataset: str
    samples: int = Field(ge=1)
    accuracy: dict[Literal["fp32", "fp16"], float]


class Provenance(_Strict):
    """Where the weights came from, so a version can be rebuilt and audited."""

    source: str
    data_sha256: str | None = Field(default=None, pattern=_SHA256)
    seed: int | None = None
    details: dict[str, str | int | float] = {}


class Manifest(_Strict):
    """Everything the loader needs to know about one model version."""

    format_version: Literal[1] = 1
    name: Name
    version: Version
    task: Literal["image-classification"] = "image-classification"
    input: InputSpec
    labels: tuple[str, ...] = Field(min_length=2)
    layers: tuple[Layer, ...]
    files: dict[FileName, Annotated[str, Field(pattern=_SHA256)]]
    provenance: Provenance
    evaluation: Evaluation | None = None

    @model_validator(mode="after")
    def _layers_are_coherent(self) -> Manifest:
        roles = [layer.role for layer in self.layers]
        if roles.count("backbone") != 1:
            raise ValueError("exactly one layer must have role 'backbone'")
        if roles.count("head") < 1:
            raise ValueError("at least one layer must have role 'head'")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer names must be unique")
        for layer in self.layers:
            for file in (layer.graph, layer.weights):
                if file not in self.files:
                    raise ValueError(f"layer {layer.name!r} names {file!r}, which has no sha256 in files")
        return self

    @property
    def backbone(self) -> Layer:
        return next(layer for layer in self.layers if layer.role == "backbone")

    @property
    def heads(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.role == "head")

    def to_json(self) -> str:
        """The manifest as ``manifest.json`` holds it. The input's ``background`` is left out where
        it is the default (black, what every manifest meant before the field): a server built before
        it refuses a manifest naming it (``extra="forbid"``), and models share a repository across a
        rolling update or a rollback. Only a model that needs another background (an export's
        ``drop``) needs a server that knows the field."""
        default = InputSpec.model_fields["background"].default
        left_out = {"input": {"background"}} if self.input.background == default else None
        return json.dumps(self.model_dump(mode="json", exclude=left_out), indent=2) + "\n"

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """Parse ``folder/manifest.json``; raises ``ValueError`` naming the file and the problem."""
        path = folder / MANIFEST_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{path}: cannot be read ({exc.strerror})") from exc
        try:
            manifest = cls.model_validate_json(text)
        except ValueError as exc:
            raise ValueError(f"{path}: invalid manifest: {exc}") from exc
        if manifest.name != folder.parent.name or manifest.version != folder.name:
            raise ValueError(
                f"{path}: says {manifest.name}/{manifest.version} but lives in {folder.parent.name}/{folder.name}"
            )
        return manifest
