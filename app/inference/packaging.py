"""Write a model version into the repository layout: graphs and weights stored apart.

Each layer is scripted to TorchScript, its parameters and buffers are saved to a
safetensors file, and the graph is saved with every tensor replaced by an empty one, so
the graph file holds code only and the weights can only come in through a safe loader.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.inference.manifest import (
    MANIFEST_FILE,
    Evaluation,
    InputSpec,
    Layer,
    Manifest,
    Provenance,
)


def sha256_bytes(data: bytes) -> str:
    """The hex sha256 of bytes already read."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _strip_tensors(module: torch.jit.ScriptModule) -> None:
    """Replace every parameter and buffer with an empty tensor of the same dtype."""
    for _, sub in module.named_modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, torch.nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=False))
        for name, buffer in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, torch.empty(0, dtype=buffer.dtype))


def _write_layer(module: torch.nn.Module, folder: Path, name: str) -> tuple[str, str]:
    module = module.eval()
    state = {key: value.detach().clone().contiguous() for key, value in module.state_dict().items()}
    scripted = torch.jit.script(module)
    _strip_tensors(scripted)
    graph_file, weights_file = f"{name}.graph.pt", f"{name}.safetensors"
    torch.jit.save(scripted, str(folder / graph_file))
    save_file(state, str(folder / weights_file))
    return graph_file, weights_file


def write_version(
    root: Path,
    *,
    name: str,
    version: str,
    backbone: torch.nn.Module,
    heads: Mapping[str, torch.nn.Module],
    input_spec: InputSpec,
    labels: tuple[str, ...],
    provenance: Provenance,
    evaluation: Evaluation | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``root/name/version`` atomically and return its path.

    The version appears complete or not at all: files are written to a temporary folder
    beside it, then renamed into place.
    """
    target = root / name / version
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists (--overwrite replaces it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
    try:
        layers = []
        for layer_name, module, role in [("backbone", backbone, "backbone")] + [
            (head_name, head, "head") for head_name, head in heads.items()
        ]:
            graph, weights = _write_layer(module, staging, layer_name)
            layers.append(Layer(name=layer_name, role=role, graph=graph, weights=weights))
        files = {
            layer_file: sha256_file(staging / layer_file)
            for layer in layers
            for layer_file in (layer.graph, layer.weights)
        }
        manifest = Manifest(
            name=name,
            version=version,
            input=input_spec,
            labels=labels,
            layers=tuple(layers),
            files=files,
            provenance=provenance,
            evaluation=evaluation,
        )
        (staging / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        # mkdtemp makes the folder private; a repository is read by whoever serves it
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
