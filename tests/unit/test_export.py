"""Exported torchvision versions serve exactly what the torchvision model computes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import save_file
from torch import nn

from app.inference.export import ExportError, export_torchvision, main
from app.inference.loader import LayeredModel
from app.inference.manifest import Manifest
from app.inference.packaging import sha256_file

FAST = ["mobilenet_v3_small", "resnet18"]
ARCHS = [*FAST, pytest.param("resnet50", marks=pytest.mark.slow)]


def _reference(arch: str, seed: int, num_classes: int = 1000) -> nn.Module:
    """The torchvision model ``export_torchvision(arch, seed=seed)`` should reproduce."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes).eval()


def _trained_like(arch: str, seed: int, num_classes: int = 1000) -> nn.Module:
    """A model whose outputs depend on its input, as a trained one's do.

    A fresh initialisation's outputs are near uniform (mobilenet's logits are ~1e-9),
    which would make comparing probabilities vacuous. Random affine batch-norm
    parameters, batch-norm statistics recalibrated on one random batch (so activations
    neither vanish nor explode), and unit-scale linear layers give logits of order one.
    """
    model = _reference(arch, seed, num_classes)
    generator = torch.Generator().manual_seed(seed)
    norms = [module for module in model.modules() if isinstance(module, nn.BatchNorm2d)]
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, 1.0 / math.sqrt(module.in_features), generator=generator)
                if module.bias is not None:
                    module.bias.uniform_(-0.1, 0.1, generator=generator)
        for norm in norms:
            norm.weight.uniform_(0.5, 1.5, generator=generator)
            norm.bias.uniform_(-0.1, 0.1, generator=generator)
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average: one batch sets the statistics
        model.train()
        model(torch.randn(4, 3, 224, 224, generator=generator))
    return model.eval()


def _load(folder: Path) -> LayeredModel:
    return LayeredModel.load(folder, Manifest.read(folder), torch.device("cpu"), torch.float32)


def _batch(model: LayeredModel, size: int = 4) -> torch.Tensor:
    spec = model.manifest.input
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (size, spec.channels, spec.height, spec.width), dtype=torch.uint8, generator=generator)


def _eager_logits(reference: nn.Module, model: LayeredModel, batch: torch.Tensor) -> torch.Tensor:
    """torchvision's eager model on the same normalised float input: (x / 255 - mean) / std."""
    spec = model.manifest.input
    mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
    std = torch.tensor(spec.std).view(1, -1, 1, 1)
    with torch.inference_mode():
        return reference((batch.float() / 255.0 - mean) / std)  # type: ignore[no-any-return]


def _assert_serves_like(folder: Path, reference: nn.Module) -> torch.Tensor:
    """Compare logits and probabilities on one uint8 batch; return the probabilities."""
    model = _load(folder)
    batch = _batch(model)
    expected = _eager_logits(reference, model, batch)
    with torch.inference_mode():
        logits = model.head()(model.features(batch))
        probabilities = model.probabilities(batch)
    scale = float(expected.abs().max())
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-4 * scale)
    torch.testing.assert_close(probabilities, torch.softmax(expected, dim=1), rtol=0, atol=1e-4)
    return probabilities


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_export_computes_the_seeded_torchvision_model(tmp_path: Path, arch: str) -> None:
    folder = export_torchvision(arch, tmp_path, seed=3)

    manifest = Manifest.read(folder)
    assert folder == tmp_path / arch / "1"
    assert manifest.labels == tuple(torchvision.models.get_model_weights(arch).DEFAULT.meta["categories"])
    transforms = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
    assert (manifest.input.height, manifest.input.width) == (transforms.crop_size[0],) * 2
    assert manifest.input.resize.mode == "shorter_side_then_center_crop"
    assert manifest.input.resize.resize_to == transforms.resize_size[0]
    assert manifest.input.mean == pytest.approx(transforms.mean)
    assert manifest.provenance.source == f"torchvision:{arch}"
    assert manifest.provenance.seed == 3
    _assert_serves_like(folder, _reference(arch, seed=3))


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_file_is_loaded_safely_and_served_exactly(tmp_path: Path, arch: str) -> None:
    source = _trained_like(arch, seed=5)
    weights = tmp_path / "weights.pt"
    torch.save(source.state_dict(), weights)

    folder = export_torchvision(arch, tmp_path / "models", weights=weights, seed=99)

    manifest = Manifest.read(folder)
    assert manifest.provenance.seed is None  # the seed played no part
    assert manifest.provenance.details["weights_sha256"] == sha256_file(weights)
    probabilities = _assert_serves_like(folder, source)
    # and the comparison was not vacuous: the outputs are far from uniform
    assert float(probabilities.max()) > 10 / len(manifest.labels)


def test_safetensors_weights_with_own_class_count(tmp_path: Path) -> None:
    source = _trained_like("mobilenet_v3_small", seed=7, num_classes=5)
    weights = tmp_path / "weights.safetensors"
    save_file({key: value.contiguous() for key, value in source.state_dict().items()}, str(weights))

    folder = export_torchvision("mobilenet_v3_small", tmp_path, name="shapes", weights=weights, num_classes=5)

    assert folder == tmp_path / "shapes" / "1"
    assert Manifest.read(folder).labels == ("class_0", "class_1", "class_2", "class_3", "class_4")
    _assert_serves_like(folder, source)


def test_weights_saved_from_a_data_parallel_model_are_served_as_the_bare_models(tmp_path: Path) -> None:
    """``nn.DataParallel(model).state_dict()`` names every tensor ``module.<name>``: they failed with
    torch's list of every missing and unexpected key."""
    source = _trained_like("mobilenet_v3_small", seed=8)
    weights = tmp_path / "weights.pt"
    torch.save(nn.DataParallel(source).state_dict(), weights)

    folder = export_torchvision("mobilenet_v3_small", tmp_path / "models", weights=weights)

    _assert_serves_like(folder, source)


def test_weights_of_the_wrong_shape_fail_clearly(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(_reference("mobilenet_v3_small", seed=0, num_classes=5).state_dict(), weights)

    with pytest.raises(ExportError, match="does not fit mobilenet_v3_small with 1000 classes"):
        export_torchvision("mobilenet_v3_small", tmp_path, weights=weights)
    assert not (tmp_path / "mobilenet_v3_small").exists()


def test_pickled_module_is_refused_by_the_safe_loader(tmp_path: Path) -> None:
    weights = tmp_path / "model.pt"
    torch.save(_reference("mobilenet_v3_small", seed=0), weights)  # a whole pickled module, not a state_dict

    with pytest.raises(ExportError, match="refused by the safe loader"):
        export_torchvision("mobilenet_v3_small", tmp_path, weights=weights)


def test_a_refused_pickle_says_how_to_save_weights_the_exporter_takes(tmp_path: Path) -> None:
    """torch's own refusal advises ``weights_only=False``, which the exporter never offers (it
    would run the file's code): the message says what to save instead, and what was refused."""
    weights = tmp_path / "model.pt"
    torch.save(_reference("mobilenet_v3_small", seed=0), weights)

    with pytest.raises(ExportError) as refused:
        export_torchvision("mobilenet_v3_small", tmp_path, weights=weights)
    message = str(refused.value)
    assert "torch.save(model.state_dict()" in message and "MobileNetV3" in message
    assert "weights_only" not in message and "\x1b" not in message


def test_a_training_checkpoint_is_named_for_what_it_holds(tmp_path: Path) -> None:
    weights = tmp_path / "checkpoint.pt"
    torch.save({"model": _reference("mobilenet_v3_small", seed=0).state_dict(), "epoch": 3}, weights)

    with pytest.raises(ExportError, match=r"holds 'model', 'epoch'.*state_dict alone"):
        export_torchvision("mobilenet_v3_small", tmp_path, weights=weights)


def test_squeezenet_cannot_be_split_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"no nn\.Linear with 1000 outputs"):
        export_torchvision("squeezenet1_0", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_architecture_with_auxiliary_classifiers_is_refused_saying_so(tmp_path: Path) -> None:
    """googlenet's scripted forward returns its auxiliary outputs with the logits; the refusal
    said only "returns GoogLeNetOutputs, not a tensor", which the README's "any architecture"
    left unexplained."""
    with pytest.raises(ExportError, match=r"auxiliary classifiers.*googlenet, inception_v3"):
        export_torchvision("googlenet", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unknown_architecture_and_bad_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="not a torchvision classification architecture"):
        export_torchvision("fasterrcnn_resnet50_fpn", tmp_path)
    with pytest.raises(ExportError, match="invalid model name"):
        export_torchvision("resnet18", tmp_path, name="../escape")
    with pytest.raises(ExportError, match="invalid version"):
        export_torchvision("resnet18", tmp_path, version="v1")


def test_graph_files_hold_code_only(tmp_path: Path) -> None:
    folder = export_torchvision("resnet18", tmp_path)

    for layer in Manifest.read(folder).layers:
        graph, weights = folder / layer.graph, folder / layer.weights
        assert graph.stat().st_size * 10 < weights.stat().st_size
        assert all(tensor.numel() == 0 for tensor in torch.jit.load(str(graph)).state_dict().values())


def test_main_writes_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--arch", "mobilenet_v3_small", "--out", str(tmp_path), "--name", "tiny", "--num-classes", "3"]

    assert main([*argv, "--seed", "1"]) == 0
    assert Manifest.read(tmp_path / "tiny" / "1").provenance.seed == 1
    assert main(argv) == 1
    assert "already exists" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert Manifest.read(tmp_path / "tiny" / "1").provenance.seed == 0


def test_num_classes_zero_is_refused_not_taken_as_unset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--arch", "mobilenet_v3_small", "--num-classes", "0", "--out", str(tmp_path)]) != 0
    assert not list(tmp_path.rglob("manifest.json")) and "at least 2" in capsys.readouterr().err
