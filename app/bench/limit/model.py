"""The model as the fastest in-process path runs it: exported when the repository lacks it, loaded
through the service's own loader, with the runtime tuned before it runs."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from app.allocator import retain_freed_memory
from app.inference.device import size_primitive_cache
from app.inference.loader import LayeredModel
from app.settings import ModelSettings

PRIMITIVE_CACHE: int = ModelSettings.model_fields["onednn_primitive_cache"].default


def tune_runtime(malloc_retain_mb: int) -> None:
    """The fastest in-process path: oneDNN's cache as the service sizes it, glibc keeping freed memory.
    Before any model runs, in every process that measures."""
    size_primitive_cache(PRIMITIVE_CACHE)
    if malloc_retain_mb:
        retain_freed_memory(malloc_retain_mb << 20)


@contextlib.contextmanager
def model_repository(root: Path | None, name: str) -> Iterator[Path]:
    """``root`` when it holds ``name``; else ``name`` exported (``--seed 0``) into ``root`` or a temporary one."""
    from app.inference.export import export_torchvision

    temporary = root is None
    folder = Path(tempfile.mkdtemp(prefix="ai-backend-limit-")) if root is None else root
    try:
        if not (folder / name).is_dir():
            print(f"exporting {name} (seed 0) into {folder}", file=sys.stderr, flush=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.jit deprecation notices
                export_torchvision(name, folder, seed=0)
        yield folder
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


def load_model(root: Path, name: str, version: str | None) -> LayeredModel:
    """The model on the CPU in fp32, through the service's own loader, every head loaded."""
    from app.inference.repository import Repository

    repository = Repository(root)
    entries = {entry.name: entry for entry in repository.models()}
    if name not in entries:
        raise LookupError(f"model {name!r} is not in {root} (it holds: {', '.join(entries) or 'none'})")
    version = version or entries[name].latest
    model = LayeredModel.load(
        repository.folder(name, version), repository.manifest(name, version), torch.device("cpu"), torch.float32
    )
    model.load_all_heads()
    return model
