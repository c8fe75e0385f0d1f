"""Export a torchvision classification model into the repository layout.

The model is built without downloading anything: its weights come from a local
state_dict file, read only through safe loaders, or from a seeded fresh initialisation.
The last ``nn.Linear`` that produces the class scores becomes the head and the rest the
backbone. The split is checked numerically, eager and scripted, before anything is
written, so an architecture whose classifier is not a final linear layer (squeezenet's
is a convolution) is refused with a clear error instead of being exported wrong.

Input size, resize and normalisation come from the metadata of the architecture's
torchvision weights enum; reading it downloads nothing.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torchvision
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torchvision.transforms import InterpolationMode

from app.inference.manifest import InputSpec, Provenance, ResizeSpec, is_valid_name, is_valid_version
from app.inference.packaging import sha256_file, write_version

HEAD_NAME = "classifier"
_FILTERS: dict[Any, Literal["bilinear", "bicubic", "nearest"]] = {
    InterpolationMode.BILINEAR: "bilinear",
    InterpolationMode.BICUBIC: "bicubic",
    InterpolationMode.NEAREST: "nearest",
}


class ExportError(ValueError):
    """The architecture, weights or options cannot make a servable version; says why."""


def _weights_entry(arch: str) -> Any:
    # DEFAULT is the recommended weight set; its preprocessing is what a state_dict of
    # those weights expects. Only metadata is read here, nothing is downloaded.
    try:
        return torchvision.models.get_model_weights(arch).DEFAULT
    except (ValueError, KeyError, AttributeError) as exc:
        raise ExportError(f"{arch}: torchvision has no weights metadata for it ({exc})") from exc


def input_spec_for(arch: str) -> InputSpec:
    """The input spec torchvision's default weights for ``arch`` were evaluated with."""
    transforms = _weights_entry(arch).transforms()
    crop, resize = int(transforms.crop_size[0]), int(transforms.resize_size[0])
    return InputSpec(
        channels=3,
        height=crop,
        width=crop,
        resize=ResizeSpec(
            mode="shorter_side_then_center_crop",
            filter=_FILTERS.get(transforms.interpolation, "bilinear"),
            resize_to=resize,
        ),
        mean=tuple(float(value) for value in transforms.mean),
        std=tuple(float(value) for value in transforms.std),
        background="drop",  # torchvision's loader: img.convert("RGB"), transparent pixels as stored
    )


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a state_dict from a local file, through loaders that cannot run code.

    ``.safetensors`` files go through safetensors; anything else through
    ``torch.load(weights_only=True)``, which refuses pickled objects other than tensors
    and plain containers.
    """
    try:
        if path.suffix == ".safetensors":
            state: object = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # how weights_only refuses anything but tensors
        raise ExportError(
            f"{path}: refused by the safe loader: it holds pickled Python objects ({_refused_object(exc)}), "
            "as a whole model saved with torch.save(model) does; save the weights alone, "
            "torch.save(model.state_dict(), path) or safetensors' save_file, and export that"
        ) from exc
    except (OSError, EOFError, SafetensorError, RuntimeError, ValueError) as exc:
        raise ExportError(f"{path}: not a loadable state_dict ({exc})") from exc
    if not isinstance(state, Mapping):
        raise ExportError(f"{path}: expected a state_dict (a mapping of names to tensors)")
    if not all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()):
        keys = ", ".join(repr(key) for key in list(state)[:5]) + (", ..." if len(state) > 5 else "")
        raise ExportError(
            f"{path}: expected a state_dict (a mapping of names to tensors), but it holds {keys}: "
            "a training checkpoint? save its model's state_dict alone"
        )
    return _unwrapped(dict(state))


def _unwrapped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict saved from a model wrapped in ``DataParallel`` or ``DistributedDataParallel``
    names every tensor ``module.<name>``: the same weights as the bare model's, renamed back."""
    prefix = "module."
    if state and all(key.startswith(prefix) for key in state):
        return {key.removeprefix(prefix): value for key, value in state.items()}
    return state


def _refused_object(exc: pickle.UnpicklingError) -> str:
    """What torch's safe loader refused, from its message; the rest of that message advises
    ``weights_only=False``, which would run the file's code and which the exporter never offers."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else "not tensors or plain containers"


def _find_head(model: nn.Module, num_classes: int) -> str:
    """Dotted name of the last ``nn.Linear`` with ``num_classes`` outputs."""
    names: list[str] = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.out_features == num_classes
    ]
    if not names:
        raise ExportError(
            f"{type(model).__name__} has no nn.Linear with {num_classes} outputs to serve as the head; "
            "only architectures whose classifier ends in a linear layer can be split"
        )
    return names[-1]


def split_model(model: nn.Module, num_classes: int) -> tuple[nn.Module, nn.Module]:
    """Detach the class-score ``nn.Linear`` as the head; the model, with nn.Identity there, is the backbone."""
    dotted = _find_head(model, num_classes)
    parent_name, _, leaf = dotted.rpartition(".")
    parent = model.get_submodule(parent_name)
    head = getattr(parent, leaf)
    setattr(parent, leaf, nn.Identity())
    return model, head


def _check_split(arch: str, expected: torch.Tensor, sample: torch.Tensor, backbone: nn.Module, head: nn.Module) -> None:
    """``head(backbone(x))`` must equal ``model(x)``, eager and once scripted as it will be served."""
    with torch.no_grad():
        eager = head(backbone(sample))
        with warnings.catch_warnings():
            # torch.jit.script's deprecation notice; a scripted googlenet's warning that it returns a tuple
            warnings.simplefilter("ignore")
            try:
                scripted_backbone, scripted_head = torch.jit.script(backbone), torch.jit.script(head)
            except Exception as exc:
                raise ExportError(f"{arch}: cannot be scripted to TorchScript ({exc})") from exc
            features = scripted_backbone(sample)
        if isinstance(features, tuple):  # GoogLeNetOutputs, InceptionOutputs: scripted, they always come
            raise ExportError(
                f"{arch}: the scripted model returns {type(features).__name__}, the outputs of its auxiliary "
                "classifiers with its logits, not a tensor: architectures with auxiliary classifiers "
                "(googlenet, inception_v3) cannot be exported"
            )
        if not isinstance(features, torch.Tensor):
            raise ExportError(f"{arch}: the scripted backbone returns {type(features).__name__}, not a tensor")
        scripted = scripted_head(features)
    for label, got in (("eager", eager), ("scripted", scripted)):
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            raise ExportError(
                f"{arch}: head(backbone(x)) != model(x) ({label}); its last linear layer is not the final "
                "operation, so it cannot be split into a backbone and a linear head"
            )


def export_torchvision(
    arch: str,
    root: Path,
    *,
    name: str | None = None,
    version: str = "1",
    weights: Path | None = None,
    seed: int = 0,
    num_classes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Export torchvision's ``arch`` to ``root/<name>/<version>`` and return the folder.

    Weights come from the local state_dict ``weights`` if given, else from a fresh
    initialisation seeded with ``seed``. ``num_classes`` defaults to the number of
    categories of the architecture's default weights (1000 for ImageNet models).
    """
    name = name or arch
    if arch not in torchvision.models.list_models(module=torchvision.models):
        raise ExportError(f"{arch!r} is not a torchvision classification architecture")
    if not is_valid_name(name):
        raise ExportError(f"invalid model name {name!r}: lowercase letters, digits, '_', '.', '-'")
    if not is_valid_version(version):
        raise ExportError(f"invalid version {version!r}: a whole number of 1-9 digits, no leading zero")
    target = root / name / version
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists (--overwrite replaces it)")
    entry = _weights_entry(arch)
    categories = tuple(str(category) for category in entry.meta.get("categories") or ())
    num_classes = len(categories) if num_classes is None else num_classes
    if num_classes < 2:
        raise ExportError(f"num_classes must be at least 2 (got {num_classes})")
    labels = categories if len(categories) == num_classes else tuple(f"class_{i}" for i in range(num_classes))
    spec = input_spec_for(arch)

    details: dict[str, str | int | float] = {
        "torchvision": torchvision.__version__,
        "preprocessing": f"{type(entry).__name__}.{entry.name}",
        "num_classes": num_classes,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        generator = torch.Generator().manual_seed(seed)
        sample = torch.randn(2, spec.channels, spec.height, spec.width, generator=generator)
    if weights is not None:
        try:
            model.load_state_dict(load_state_dict(weights))
        except RuntimeError as exc:
            raise ExportError(
                f"{weights}: does not fit {arch} with {num_classes} classes (pass --num-classes?): {exc}"
            ) from exc
        details |= {"weights_file": weights.name, "weights_sha256": sha256_file(weights)}
    else:
        details["init"] = f"fresh, torch.manual_seed({seed})"
    model.eval()
    with torch.no_grad():
        expected = model(sample)
    backbone, head = split_model(model, num_classes)
    _check_split(arch, expected, sample, backbone, head)
    return write_version(
        root,
        name=name,
        version=version,
        backbone=backbone,
        heads={HEAD_NAME: head},
        input_spec=spec,
        labels=labels,
        provenance=Provenance(
            source=f"torchvision:{arch}", seed=None if weights is not None else seed, details=details
        ),
        overwrite=overwrite,
    )


def main(argv: list[str] | None = None) -> int:
    """``export``: write a torchvision architecture as a model version."""
    parser = argparse.ArgumentParser(
        prog="ai-backend export", description="Export a torchvision classifier as a model version."
    )
    parser.add_argument("--arch", required=True, help="torchvision architecture, e.g. resnet18")
    parser.add_argument("--out", type=Path, default=Path("models"), help="model repository root (default: models)")
    parser.add_argument("--name", help="model name (default: the architecture)")
    parser.add_argument("--version", default="1", help="version folder to write (default: 1)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--weights", type=Path, help="local state_dict (.safetensors, or a torch.save file)")
    # default None, so that an explicit --seed 0 counts as given and --weights beside it is refused
    source.add_argument("--seed", type=int, help="seed for a fresh initialisation (default: 0)")
    parser.add_argument("--num-classes", type=int, help="class count (default: the weights metadata's)")
    parser.add_argument("--overwrite", action="store_true", help="replace the version if it exists")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():  # found before the export, not after it
        parser.error(f"--out {args.out} is not a directory (the model repository's root)")
    with warnings.catch_warnings():
        # write_version uses TorchScript on purpose (see DESIGN.md); its deprecation
        # notices would only bury the one line this command prints.
        warnings.filterwarnings("ignore", message=r".*torch\.jit.* is deprecated", category=FutureWarning)
        try:
            folder = export_torchvision(
                args.arch,
                args.out,
                name=args.name,
                version=args.version,
                weights=args.weights,
                seed=0 if args.seed is None else args.seed,
                num_classes=args.num_classes,
                overwrite=args.overwrite,
            )
        except (ExportError, OSError) as exc:  # a file there already, a folder that cannot be made
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(f"wrote {folder}")
    return 0
