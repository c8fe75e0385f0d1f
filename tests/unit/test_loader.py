"""Layered loading: graphs and weights apart, lazy heads, and every broken file named."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from app.inference.device import resolve_device, resolve_dtype
from app.inference.loader import LayeredModel, ModelLoadError
from app.inference.manifest import MANIFEST_FILE, Evaluation, InputSpec, Manifest, Provenance
from app.inference.packaging import sha256_file, write_version
from tests.faults import out_of_memory_in_graph

SPEC = InputSpec(channels=1, height=8, width=8, mean=(0.25,), std=(0.5,))


def tiny_modules(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    backbone = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(256, 6)
    )
    with torch.no_grad():  # non-trivial running statistics, so a lost buffer would show
        backbone[1].running_mean.uniform_(-0.5, 0.5)
        backbone[1].running_var.uniform_(0.5, 2.0)
    return backbone.eval(), nn.Linear(6, 3).eval()


def write_modules(folder: Path, name: str, backbone: nn.Module, head: nn.Module, spec: InputSpec) -> Path:
    return write_version(
        folder,
        name=name,
        version="1",
        backbone=backbone,
        heads={"classifier": head},
        input_spec=spec,
        labels=("a", "b", "c"),
        provenance=Provenance(source="tests", seed=0),
        evaluation=Evaluation(dataset="none", samples=1, accuracy={"fp32": 1.0}),
    )


@pytest.fixture
def version(tmp_path: Path) -> Path:
    backbone, head = tiny_modules()
    return write_modules(tmp_path, "tiny", backbone, head, SPEC)


def load(folder: Path, dtype: torch.dtype = torch.float32) -> LayeredModel:
    return LayeredModel.load(folder, Manifest.read(folder), torch.device("cpu"), dtype)


def reference(images: torch.Tensor) -> torch.Tensor:
    backbone, head = tiny_modules()
    x = (images.float() / 255 - 0.25) / 0.5
    with torch.no_grad():
        return torch.softmax(head(backbone(x)), dim=1)


def test_the_loaded_model_matches_the_modules_it_was_written_from(version: Path) -> None:
    images = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8)
    with torch.inference_mode():
        served = load(version).probabilities(images)
    torch.testing.assert_close(served, reference(images), atol=1e-5, rtol=1e-4)


def test_graph_files_hold_code_and_weights_files_hold_tensors(version: Path) -> None:
    graph = torch.jit.load(str(version / "backbone.graph.pt"))
    assert all(t.numel() == 0 for t in graph.state_dict().values())
    assert (version / "backbone.safetensors").stat().st_size > 1000


def test_heads_load_on_first_use_exactly_once_under_concurrency(version: Path) -> None:
    model = load(version)
    assert model.loaded_heads == ()
    barrier = threading.Barrier(8)

    def use() -> None:
        barrier.wait()
        model.head()

    threads = [threading.Thread(target=use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert model.loaded_heads == ("classifier",)
    assert model.head_loads == 1


def test_self_check_and_warm_up_run_on_the_loaded_model(version: Path) -> None:
    model = load(version)
    model.load_all_heads()
    model.self_check()
    model.warm_up(4)


def test_fp16_weights_are_cast_on_the_host(version: Path) -> None:
    model = load(version, torch.float16)
    with torch.inference_mode():
        features = model.features(model.dummy_batch(2))
    assert features.dtype == torch.float16


def test_a_changed_file_fails_its_checksum_naming_the_file(version: Path) -> None:
    weights = version / "backbone.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"backbone\.safetensors: sha256 mismatch"):
        load(version)


def _rewrite_checksum(version: Path, file: str) -> None:
    manifest = json.loads((version / MANIFEST_FILE).read_text())
    manifest["files"][file] = sha256_file(version / file)
    (version / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_truncated_weights_file_is_named_even_with_a_matching_checksum(version: Path) -> None:
    weights = version / "backbone.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    _rewrite_checksum(version, "backbone.safetensors")
    with pytest.raises(ModelLoadError, match=r"backbone\.safetensors: not a readable safetensors file"):
        load(version)


def test_a_truncated_graph_is_named(version: Path) -> None:
    graph = version / "backbone.graph.pt"
    graph.write_bytes(graph.read_bytes()[:500])
    _rewrite_checksum(version, "backbone.graph.pt")
    with pytest.raises(ModelLoadError, match=r"backbone\.graph\.pt: not a loadable TorchScript graph"):
        load(version)


def test_weights_of_another_model_are_a_mismatch(version: Path) -> None:
    shutil.copy(version / "classifier.safetensors", version / "backbone.safetensors")
    _rewrite_checksum(version, "backbone.safetensors")
    with pytest.raises(ModelLoadError, match=r"backbone\.safetensors: does not match backbone\.graph\.pt"):
        load(version)


def test_weights_of_the_wrong_shape_fail_the_self_check(version: Path, tmp_path: Path) -> None:
    other = write_version(
        tmp_path / "other",
        name="tiny",
        version="1",
        backbone=tiny_modules()[0],
        heads={"classifier": nn.Linear(6, 5)},  # five classes where the manifest has three
        input_spec=SPEC,
        labels=("a", "b", "c"),
        provenance=Provenance(source="tests"),
    )
    shutil.copy(other / "classifier.safetensors", version / "classifier.safetensors")
    _rewrite_checksum(version, "classifier.safetensors")
    model = load(version)
    with pytest.raises(ModelLoadError, match="self-check failed, head classifier"):
        model.head()


def test_a_head_that_does_not_fit_the_backbone_is_a_load_error_and_is_not_loaded_again(
    version: Path, tmp_path: Path
) -> None:
    # seven inputs where the backbone gives six: TorchScript's RuntimeError is the model's fault,
    # named as such, and the head is not read, frozen and run again on every batch
    other = write_version(
        tmp_path / "other",
        name="tiny",
        version="1",
        backbone=tiny_modules()[0],
        heads={"classifier": nn.Linear(7, 3)},
        input_spec=SPEC,
        labels=("a", "b", "c"),
        provenance=Provenance(source="tests"),
    )
    for file in ("classifier.graph.pt", "classifier.safetensors"):
        shutil.copy(other / file, version / file)
        _rewrite_checksum(version, file)
    model = load(version)
    for _ in range(3):
        with pytest.raises(ModelLoadError, match=rf"{version}: self-check failed, head classifier cannot run"):
            model.head()
    assert model.head_loads == 0 and model.loaded_heads == ()
    assert list(model.failed_heads) == ["classifier"]


def test_the_device_out_of_memory_in_a_self_check_is_not_taken_for_a_broken_model(version: Path) -> None:
    # the device's fault, raised through the graph as a plain RuntimeError: it passes, and may
    # pass; the head is not marked as one that can never serve
    model = out_of_memory_in_graph(load(version), fail_at=1)
    for check in (model.self_check, model.head):
        with pytest.raises(RuntimeError, match="out of memory") as raised:
            check()
        assert not isinstance(raised.value, ModelLoadError)
    assert model.failed_heads == {}


def test_integer_weights_for_a_float_graph_fail_the_self_check_naming_the_folder(version: Path) -> None:
    weights = version / "backbone.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    tensors["0.weight"] = tensors["0.weight"].to(torch.int32)
    safetensors.torch.save_file(tensors, str(weights))
    _rewrite_checksum(version, "backbone.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{version}: self-check failed, the backbone cannot run"):
        load(version).self_check()


def test_a_head_whose_file_is_away_for_now_is_tried_again_on_its_next_use(version: Path) -> None:
    model = load(version)
    graph = version / "classifier.graph.pt"
    away = graph.rename(version / "away")  # a volume remounting, say
    with pytest.raises(ModelLoadError, match="file is missing"):
        model.head()
    assert model.failed_heads == {}
    away.rename(graph)
    model.head()
    assert model.loaded_heads == ("classifier",) and model.head_loads == 1


def test_what_serves_owes_nothing_to_the_files_once_loaded(version: Path) -> None:
    # a file rewritten in place (cp over it, rsync --inplace): a memory-mapped weights file
    # would change the served weights under the running model, or kill it (SIGBUS) if cut short
    model = load(version)
    model.head()
    images = torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8)
    with torch.inference_mode():
        before = model.probabilities(images)
    for file in ("backbone.safetensors", "classifier.safetensors"):
        path = version / file
        header = int.from_bytes(path.read_bytes()[:8], "little") + 8
        with path.open("r+b") as handle:
            handle.seek(header)
            handle.write(b"\xff" * (path.stat().st_size - header))  # every weight NaN
    with torch.inference_mode():
        after = model.probabilities(images)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_a_missing_head_file_stops_the_load_even_though_heads_are_lazy(version: Path) -> None:
    (version / "classifier.graph.pt").unlink()
    with pytest.raises(ModelLoadError, match=r"classifier\.graph\.pt: file is missing"):
        load(version)


def test_a_manifest_in_the_wrong_folder_is_refused(version: Path, tmp_path: Path) -> None:
    moved = tmp_path / "tiny" / "2"
    version.rename(moved)
    with pytest.raises(ValueError, match="says tiny/1 but lives in tiny/2"):
        Manifest.read(moved)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["files"].pop("backbone.graph.pt"), "has no sha256 in files"),
        (lambda m: m.update(layers=[m["layers"][1]]), "exactly one layer must have role 'backbone'"),
        (lambda m: m["input"].update(mean=[0.1, 0.2]), "one value per channel"),
        (lambda m: m["files"].update({"../../etc/passwd": "0" * 64}), "files"),
        (lambda m: m.update(extra="field"), "extra"),
    ],
    ids=["unlisted-file", "no-backbone", "mean-per-channel", "traversal", "unknown-field"],
)
def test_an_invalid_manifest_is_refused_naming_the_file(version: Path, edit, message: str) -> None:
    manifest = json.loads((version / MANIFEST_FILE).read_text())
    edit(manifest)
    (version / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest.json") as caught:
        Manifest.read(version)
    assert message in str(caught.value)


def test_a_manifest_that_is_not_json_is_refused(version: Path) -> None:
    (version / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="invalid manifest"):
        Manifest.read(version)


def test_device_and_precision_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda:0")) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            resolve_device("cuda")


def weights(graph: torch._C.Graph) -> set[int]:
    """Where the tensors a frozen graph holds live."""
    return {
        node.t("value").data_ptr()
        for node in graph.nodes()
        if node.kind() == "prim::Constant" and node.hasAttribute("value") and node.kindOf("value") == "t"
    }


def test_a_convolutional_backbone_runs_channels_last_and_answers_as_its_modules(tmp_path: Path) -> None:
    """Convolutions are served channels-last (weights and batch laid out N x H x W x C), and the
    per-channel normalisation done row by row on that layout gives the modules' own answers,
    whichever layout the batch comes in."""
    spec = InputSpec(channels=3, height=6, width=5, mean=(0.1, 0.5, 0.9), std=(0.2, 0.4, 0.8))
    torch.manual_seed(1)
    backbone = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(120, 6)
    )
    head = nn.Linear(6, 3)
    with torch.no_grad():
        backbone[1].running_mean.uniform_(-0.5, 0.5)
        backbone[1].running_var.uniform_(0.5, 2.0)
    backbone.eval(), head.eval()
    folder = write_modules(tmp_path, "colour", backbone, head, spec)
    model = load(folder)
    assert model.channels_last
    images = torch.randint(0, 256, (4, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    mean, std = torch.tensor(spec.mean).view(1, 3, 1, 1), torch.tensor(spec.std).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = torch.softmax(head(backbone((images.float() / 255 - mean) / std)), dim=1)
    with torch.inference_mode():
        for batch in (images, images.contiguous(memory_format=torch.channels_last)):
            torch.testing.assert_close(model.probabilities(batch), expected, rtol=1e-5, atol=1e-6)
        for size in (1, 2, 17):  # oneDNN's kernels whatever the batch size, ATen's choice before
            torch.testing.assert_close(
                model.probabilities(images.repeat(5, 1, 1, 1)[:size]), expected.repeat(5, 1)[:size]
            )
    # batches of ONEDNN_FROM_BATCH or more run a copy of the graph with oneDNN's convolutions, sharing its weights
    assert model.batched_backbone is not None
    batched = {node.kind() for node in model.batched_backbone.graph.nodes()}  # type: ignore[attr-defined]
    assert "aten::mkldnn_convolution" in batched and "aten::conv2d" not in batched
    assert "aten::conv2d" in {node.kind() for node in model.backbone.graph.nodes()}
    shared = weights(model.batched_backbone.graph)  # type: ignore[attr-defined]
    assert shared and shared == weights(model.backbone.graph)
    decoded = [image.permute(1, 2, 0).contiguous().permute(2, 0, 1) for image in images]  # as the decode leaves them
    batch = model.batch(decoded)
    assert batch.is_contiguous(memory_format=torch.channels_last) and torch.equal(batch, images)
    half = load(folder, torch.float16)  # oneDNN's half precision needs CPU support: ATen keeps them
    assert half.batched_backbone is None


def test_a_backbone_without_convolutions_keeps_its_layout(tmp_path: Path) -> None:
    torch.manual_seed(3)
    backbone, head = nn.Sequential(nn.Flatten(), nn.Linear(64, 6)).eval(), nn.Linear(6, 3).eval()
    folder = write_modules(tmp_path, "flat", backbone, head, SPEC)
    model = load(folder)
    assert not model.channels_last
    decoded = [torch.arange(60, dtype=torch.uint8).view(4, 5, 3).permute(2, 0, 1) + i for i in range(2)]
    batch = model.batch(decoded)  # N x C x H x W, from images laid out H x W x C
    assert batch.is_contiguous() and torch.equal(batch, torch.stack([image.contiguous() for image in decoded]))
    images = torch.randint(0, 256, (3, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = torch.softmax(head(backbone((images.float() / 255 - 0.25) / 0.5)), dim=1)
    with torch.inference_mode():
        torch.testing.assert_close(model.probabilities(images), expected, rtol=1e-5, atol=1e-6)


def test_a_convolution_padded_by_name_keeps_aten_and_still_serves(tmp_path: Path) -> None:
    """oneDNN's op takes only explicit padding: rewritten, a ``padding="same"`` convolution would
    make a graph that cannot run, and the version would fail its self-check."""
    torch.manual_seed(5)
    backbone = nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"), nn.ReLU(), nn.Flatten(), nn.Linear(128, 6)).eval()
    head = nn.Linear(6, 3).eval()
    model = load(write_modules(tmp_path, "same", backbone, head, SPEC))
    assert model.channels_last and model.batched_backbone is None
    images = torch.randint(0, 256, (3, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = torch.softmax(head(backbone((images.float() / 255 - 0.25) / 0.5)), dim=1)
    with torch.inference_mode():
        torch.testing.assert_close(model.probabilities(images), expected, rtol=1e-5, atol=1e-6)


class _Pair(nn.Module):
    """A module returning its inner module's output twice, as a tuple or a list."""

    def __init__(self, inner: nn.Module, kind: str) -> None:
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor]:
        y = self.inner(x)
        return (y, y) if self.kind == "tuple" else [y, y]


@pytest.mark.parametrize(
    ("part", "kind"),
    [("backbone", "tuple"), ("head", "tuple"), ("head", "list")],
    ids=["backbone", "head", "head-list"],
)
def test_a_graph_whose_output_is_not_a_tensor_is_a_load_error_naming_the_folder(
    tmp_path: Path, part: str, kind: str
) -> None:
    """It was a TypeError or an AttributeError that nothing took for the model's fault: a 500 to
    an admin load, and with the warm-up off a version that loaded, said it was healthy and
    answered 500 to every request, its head read and run again on each batch."""
    backbone, head = tiny_modules()
    backbone, head = (_Pair(backbone, kind), head) if part == "backbone" else (backbone, _Pair(head, kind))
    folder = write_modules(tmp_path, "tiny", torch.jit.script(backbone), torch.jit.script(head), SPEC)
    what = "the backbone" if part == "backbone" else "head classifier"
    message = rf"{folder}: self-check failed, {what} returns a {kind}, not a tensor"
    model = load(folder)
    for _ in range(2):
        with pytest.raises(ModelLoadError, match=message) as refused:
            model.self_check() if part == "backbone" else model.head()
        assert str(refused.value).count("self-check failed") == 1, refused.value
    if part == "head":
        assert list(model.failed_heads) == ["classifier"] and model.head_loads == 0
