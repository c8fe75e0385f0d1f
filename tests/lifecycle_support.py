"""Model versions for the lifecycle tests: copies of the bundled digits version, some made worse on purpose."""

from __future__ import annotations

import json
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.inference.loader import LayeredModel
from app.inference.manifest import MANIFEST_FILE, Manifest
from app.inference.packaging import sha256_file
from tests.support import DIGITS_DIR, MODEL_NAME

HEAD_WEIGHTS = "classifier.safetensors"


def _rewrite_manifest(folder: Path, **changes: object) -> Manifest:
    """Change top-level fields of ``folder``'s manifest, written as packaging writes it, and read it back."""
    path = folder / MANIFEST_FILE
    raw = json.loads(path.read_text(encoding="utf-8"))
    raw.update(changes)
    path.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    return Manifest.read(folder)


def copy_version(root: Path, version: str = "1", *, source: str = "1") -> Path:
    """``models/digits/<source>`` copied to ``root/digits/<version>``, its manifest saying so."""
    target = root / MODEL_NAME / version
    shutil.copytree(DIGITS_DIR / source, target)
    if version != source:
        _rewrite_manifest(target, version=version)
    return target


def degrade_head(folder: Path, noise: float, seed: int = 0) -> Manifest:
    """Add Gaussian noise (``noise`` x the weights' own std) to the classifier head, as a bad retrain would.

    The head's sha256 in the manifest is updated so the version still loads, and the copied
    evaluation is cleared: it described the weights before the damage.
    """
    path = folder / HEAD_WEIGHTS
    weights = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    damaged = {
        key: (value + torch.randn(value.shape, generator=generator) * noise * value.std()).contiguous()
        for key, value in weights.items()
    }
    save_file(damaged, str(path))
    files = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
    files[HEAD_WEIGHTS] = sha256_file(path)
    return _rewrite_manifest(folder, files=files, evaluation=None)


class StuckLoads:
    """``LayeredModel.load`` held at a gate: each load says it started, waits for ``gate`` (30 s
    at most), then loads for real. ``calls`` counts the loads that started, ``made`` holds a weak
    reference to each model they made (gone once the service dropped it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started, self.gate = threading.Event(), threading.Event()
        self.calls = 0
        self.made: list[weakref.ref[LayeredModel]] = []
        self._real = LayeredModel.load
        self._monkeypatch = monkeypatch
        monkeypatch.setattr(LayeredModel, "load", self._load)

    def _load(self, *args: object, **kwargs: object) -> LayeredModel:
        self.calls += 1
        self.started.set()
        self.gate.wait(30)
        model = self._real(*args, **kwargs)  # type: ignore[arg-type]
        self.made.append(weakref.ref(model))
        return model

    def restore(self) -> None:
        """Loads are the real ones again (a load held at the gate still waits for it)."""
        self._monkeypatch.setattr(LayeredModel, "load", self._real)
