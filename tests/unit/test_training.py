"""The digits trainer is deterministic, and the bundled model is what its manifest says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.inference.loader import LayeredModel
from app.inference.manifest import Manifest
from app.training.digits import build, load_split, main, train, write_samples

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "digits"


def _load(folder: Path) -> LayeredModel:
    return LayeredModel.load(folder, Manifest.read(folder), torch.device("cpu"), torch.float32)


def _heldout_accuracy(model: LayeredModel, seed: int) -> float:
    split = load_split(seed)
    with torch.inference_mode():
        predicted = model.probabilities(torch.from_numpy(split.heldout_images).unsqueeze(1)).argmax(dim=1)
    return float((predicted.numpy() == split.heldout_labels).mean())


def _classify(model: LayeredModel, image: Image.Image) -> str:
    """What the service does for this model: grey, box-filter stretch to 8x8, uint8 in."""
    pixels = np.asarray(image.convert("L").resize((8, 8), Image.Resampling.BOX), dtype=np.uint8)
    with torch.inference_mode():
        index = int(model.probabilities(torch.from_numpy(pixels.copy())[None, None]).argmax())
    return model.manifest.labels[index]


def test_load_split_is_deterministic_and_stratified() -> None:
    first, again, other = load_split(0), load_split(0), load_split(1)

    for name in ("train_images", "train_labels", "heldout_images", "heldout_labels"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert first.train_images.shape == (1437, 8, 8)
    assert first.heldout_images.shape == (360, 8, 8)
    assert first.train_images.dtype == np.uint8
    assert (first.train_images.min(), first.train_images.max()) == (0, 255)
    per_class = np.bincount(first.heldout_labels) / np.bincount(
        np.concatenate([first.train_labels, first.heldout_labels])
    )
    assert np.all(np.abs(per_class - 0.2) < 0.02)  # stratified: a fifth of every class
    assert first.data_sha256 == other.data_sha256  # same data, another split
    assert not np.array_equal(first.heldout_labels, other.heldout_labels)


def test_training_twice_with_one_seed_gives_identical_weights() -> None:
    rng_before = torch.random.get_rng_state()
    threads_before = torch.get_num_threads()
    backbone, head, accuracy = train(seed=0, epochs=2)
    backbone_again, head_again, accuracy_again = train(seed=0, epochs=2)

    for ours, theirs in ((backbone, backbone_again), (head, head_again)):
        mine, other = ours.state_dict(), theirs.state_dict()
        assert mine.keys() == other.keys()
        assert all(torch.equal(mine[key], other[key]) for key in mine)
    assert accuracy == accuracy_again
    _, other_head, _ = train(seed=1, epochs=1)
    assert not torch.equal(head.state_dict()["weight"], other_head.state_dict()["weight"])
    # the caller's global state is left as it was
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.get_num_threads() == threads_before
    assert not torch.are_deterministic_algorithms_enabled()


def test_build_records_the_accuracy_the_loader_measures(tmp_path: Path) -> None:
    folder = build(tmp_path, "7", seed=2, epochs=2)

    manifest = Manifest.read(folder)
    assert folder == tmp_path / "digits" / "7"
    assert manifest.evaluation is not None
    assert manifest.evaluation.samples == 360
    assert manifest.evaluation.accuracy["fp32"] == _heldout_accuracy(_load(folder), seed=2)
    assert manifest.provenance.seed == 2
    assert manifest.provenance.data_sha256 == load_split(2).data_sha256
    assert manifest.input.resize.filter == "box"
    with pytest.raises(FileExistsError):
        build(tmp_path, "7", seed=2, epochs=1)


def test_samples_downsample_to_the_heldout_images(tmp_path: Path) -> None:
    split = load_split(0)
    paths = write_samples(tmp_path, split)

    assert [path.name for path in paths] == [f"digit_{digit}.png" for digit in range(10)]
    for digit, path in enumerate(paths):
        with Image.open(path) as image:
            assert (image.mode, image.size) == ("L", (64, 64))
            pixels = np.asarray(image.resize((8, 8), Image.Resampling.BOX))
        matches = [
            i for i in np.flatnonzero(split.heldout_labels == digit) if np.array_equal(split.heldout_images[i], pixels)
        ]
        assert matches


def test_main_builds_version_and_samples(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--version", "3", "--epochs", "1"]) == 0
    assert Manifest.read(tmp_path / "digits" / "3").evaluation is not None
    assert len(list((tmp_path / "digits" / "samples").glob("digit_*.png"))) == 10
    assert main(["--out", str(tmp_path), "--version", "3", "--epochs", "1"]) == 1


def test_importing_the_trainer_does_not_import_sklearn() -> None:
    code = "import sys, app.training.digits; assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=BUNDLED.parents[1])


def test_bundled_model_reaches_the_accuracy_in_its_manifest() -> None:
    folder = BUNDLED / "1"
    model = _load(folder)
    manifest = model.manifest
    seed = manifest.provenance.seed
    assert seed is not None
    assert manifest.evaluation is not None

    assert manifest.provenance.data_sha256 == load_split(seed).data_sha256
    measured = _heldout_accuracy(model, seed)
    assert abs(measured - manifest.evaluation.accuracy["fp32"]) <= 1e-9
    assert measured >= 0.97
    assert sum(path.stat().st_size for path in folder.iterdir()) < 1_000_000


def test_bundled_samples_are_classified_right_at_any_size() -> None:
    model = _load(BUNDLED / "1")
    for digit in range(10):
        with Image.open(BUNDLED / "samples" / f"digit_{digit}.png") as image:
            image.load()
        assert _classify(model, image) == str(digit)
        assert _classify(model, image.resize((256, 256), Image.Resampling.BILINEAR)) == str(digit)
        assert _classify(model, image.resize((32, 32), Image.Resampling.BILINEAR)) == str(digit)
        assert _classify(model, image.convert("RGB").resize((300, 200), Image.Resampling.BICUBIC)) == str(digit)
