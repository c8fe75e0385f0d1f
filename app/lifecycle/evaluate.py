"""``ai-backend eval``: a version's held-out accuracy, measured as it is served, into its manifest.

The version runs at each precision it will be served in: fp32 always, fp16 where CUDA is
(``auto``: the service serves fp16 there). On the CPU fp16 runs only when asked for by name,
as the service serves it there only when ``model.dtype`` says float16: 20-40x slower.
Every image goes through ``preprocess.decode``, the path a request takes, so the figure is
the served model's. The held-out set is an image folder (``--data``: one subfolder per label,
named exactly as the manifest's labels) or, for a version built by ``app.training.digits``,
that trainer's own held-out split with the seed its provenance names.

The figures replace the manifest's ``evaluation``; every other field is kept as written.
The manifest is replaced atomically and read back through ``Manifest`` to prove it valid.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from app.errors import ServiceError
from app.inference.manifest import MANIFEST_FILE, Evaluation, Manifest
from app.inference.preprocess import ImageLimits, decode

Precision = Literal["fp32", "fp16"]
DTYPES: dict[Precision, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})
DIGITS_SOURCE = "app.training.digits"


class EvaluationError(ValueError):
    """The version cannot be evaluated as asked; the message says why and what would do."""


@dataclass(frozen=True)
class HeldOut:
    """Decoded held-out images (``N x C x H x W`` uint8) and their label indices (``N`` int64)."""

    dataset: str
    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def first(self, count: int) -> HeldOut:
        """The first ``count`` samples (all of them when there are no more)."""
        if count >= len(self):
            return self
        return replace(
            self,
            dataset=f"{self.dataset}, first {count} of {len(self)}",
            images=self.images[:count],
            labels=self.labels[:count],
        )


def _serving_limits() -> ImageLimits:
    # The service's default limits: an image the service would refuse stops the evaluation.
    from app.settings import ServerSettings

    server = ServerSettings()
    return ImageLimits(server.max_image_bytes, server.max_image_pixels, server.jpeg_reduced_decode)


def resolve_precisions(setting: str, device: torch.device) -> tuple[Precision, ...]:
    """``auto``, ``fp32``, ``fp16`` or ``fp32,fp16`` on ``device``; fp32 is always measured.

    fp32 comes along with fp16 because the FP16 gate compares the two. ``auto`` is fp16 on CUDA
    only; fp16 named on another device runs there (``slow_precision_warning`` says what it costs).
    """
    if setting == "auto":
        return ("fp32", "fp16") if device.type == "cuda" else ("fp32",)
    asked = {part.strip() for part in setting.split(",")}
    unknown = sorted(asked - set(DTYPES))
    if unknown:
        raise EvaluationError(f"unknown precision {', '.join(map(repr, unknown))}: use auto, fp32, fp16 or fp32,fp16")
    return ("fp32", "fp16") if "fp16" in asked else ("fp32",)


def slow_precision_warning(precisions: tuple[Precision, ...], device: torch.device) -> str | None:
    """A warning where fp16 runs off CUDA: it is measured because the service serves it there
    when ``model.dtype`` is float16, but it takes 20-40x as long as fp32."""
    if "fp16" not in precisions or device.type == "cuda":
        return None
    return (
        f"warning: fp16 on {device.type} runs 20-40x slower than fp32; it is measured because a service "
        f"with model.dtype=float16 serves it there (auto serves fp32 on {device.type})"
    )


def _png(pixels: npt.NDArray[np.uint8]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")  # a 2-D uint8 array: mode "L", pixel for pixel
    return buffer.getvalue()


def digits_heldout(manifest: Manifest, limits: ImageLimits) -> HeldOut:
    """The digits trainer's held-out split for the seed in ``manifest``'s provenance.

    The split's 8x8 uint8 images are written as PNG and decoded as a request would be,
    so they take the very path the served model's input does (including ``fit_content``).
    """
    name = f"{manifest.name}/{manifest.version}"
    provenance = manifest.provenance
    if provenance.source != DIGITS_SOURCE:
        raise EvaluationError(
            f"{name} was not built by {DIGITS_SOURCE} (its provenance source is {provenance.source!r}), so there "
            "is no held-out split to take: pass --data DIR, an image folder with one subfolder per label"
        )
    if provenance.seed is None:
        raise EvaluationError(f"{name}'s provenance names no seed, so its held-out split is unknown: pass --data DIR")
    from app.training.digits import DATASET, load_split

    try:
        split = load_split(provenance.seed)
    except ImportError as exc:
        raise EvaluationError(
            f"the digits held-out split needs scikit-learn, a development dependency ({exc}): "
            "install the dev group or pass --data DIR"
        ) from exc
    if provenance.data_sha256 is not None and provenance.data_sha256 != split.data_sha256:
        raise EvaluationError(
            f"the digits data this scikit-learn ships (sha256 {split.data_sha256[:12]}...) is not the data {name} "
            f"was trained on ({provenance.data_sha256[:12]}...), so its held-out split cannot be rebuilt: "
            "pass --data DIR"
        )
    index = {label: position for position, label in enumerate(manifest.labels)}
    missing = sorted({str(label) for label in split.heldout_labels.tolist()} - set(index))
    if missing:
        raise EvaluationError(f"{name} has no labels {missing}, which the digits split uses: pass --data DIR")
    images = torch.stack([decode(_png(pixels), manifest.input, limits) for pixels in split.heldout_images])
    labels = torch.tensor([index[str(label)] for label in split.heldout_labels.tolist()], dtype=torch.int64)
    dataset = f"{DATASET} held-out split (seed {provenance.seed}), as PNG through preprocess.decode"
    return HeldOut(dataset, images, labels)


def image_folder(root: Path, manifest: Manifest, limits: ImageLimits) -> HeldOut:
    """Every JPEG, PNG and WebP file in ``root/<label>/``, decoded as a request would be.

    The dataset name carries a digest of the (label, image bytes) pairs, independent of
    file names and order, so two evaluations can be told apart or matched.
    """
    if not root.is_dir():
        raise EvaluationError(f"--data {root} is not a directory")
    index = {label: position for position, label in enumerate(manifest.labels)}
    folders = sorted(path for path in root.iterdir() if path.is_dir() and not path.name.startswith("."))
    unknown = [folder.name for folder in folders if folder.name not in index]
    if unknown:
        raise EvaluationError(
            f"{root}: subfolders {unknown[:5]} are not labels of {manifest.name}/{manifest.version}; name each "
            f"subfolder exactly as a label (its labels begin {list(manifest.labels[:3])})"
        )
    images: list[torch.Tensor] = []
    labels: list[int] = []
    entries: list[bytes] = []
    for folder in folders:
        for path in sorted(folder.iterdir()):
            if not path.is_file() or path.name.startswith(".") or path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            data = path.read_bytes()
            try:
                images.append(decode(data, manifest.input, limits))
            except ServiceError as exc:
                raise EvaluationError(f"{path}: the service would refuse this image: {exc.message}") from exc
            labels.append(index[folder.name])
            entries.append(hashlib.sha256(folder.name.encode()).digest() + hashlib.sha256(data).digest())
    if not images:
        raise EvaluationError(f"{root}: no .jpg, .jpeg, .png or .webp files in subfolders named after labels")
    digest = hashlib.sha256(b"".join(sorted(entries))).hexdigest()
    dataset = f"image folder {root.name} (sha256 {digest[:16]}), through preprocess.decode"
    return HeldOut(dataset, torch.stack(images), torch.tensor(labels, dtype=torch.int64))


def correct_count(
    folder: Path, manifest: Manifest, heldout: HeldOut, device: torch.device, dtype: torch.dtype, batch_size: int
) -> int:
    """How many held-out images the version's default head gets right, loaded as the service loads it."""
    from app.inference.loader import LayeredModel

    model = LayeredModel.load(folder, manifest, device, dtype)
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(heldout), batch_size):
            predicted = model.probabilities(heldout.images[start : start + batch_size]).argmax(dim=1).cpu()
            correct += int((predicted == heldout.labels[start : start + batch_size]).sum())
    return correct


def evaluate(
    folder: Path,
    manifest: Manifest,
    heldout: HeldOut,
    device: torch.device,
    precisions: tuple[Precision, ...],
    batch_size: int = 64,
) -> tuple[Evaluation, dict[Precision, float]]:
    """The version's accuracy on ``heldout`` at each precision, and the seconds each took.

    Raises ``ModelLoadError`` when the version's files do not load.
    """
    accuracy: dict[Precision, float] = {}
    seconds: dict[Precision, float] = {}
    for precision in precisions:
        started = time.perf_counter()
        correct = correct_count(folder, manifest, heldout, device, DTYPES[precision], batch_size)
        seconds[precision] = time.perf_counter() - started
        accuracy[precision] = correct / len(heldout)
    return Evaluation(dataset=heldout.dataset, samples=len(heldout), accuracy=accuracy), seconds


def manifest_text(folder: Path, evaluation: Evaluation) -> str:
    """The manifest's JSON with ``evaluation`` replaced and every other value as written.

    Formatted as ``app.inference.packaging`` writes it (indent 2, trailing newline). Raises
    ``ValueError`` if the result would not parse back into the same manifest.
    """
    before = Manifest.read(folder)
    raw = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    raw["evaluation"] = evaluation.model_dump(mode="json")
    text = json.dumps(raw, indent=2) + "\n"
    if Manifest.model_validate_json(text) != before.model_copy(update={"evaluation": evaluation}):
        raise ValueError(f"{folder / MANIFEST_FILE}: rewriting the evaluation would change more than the evaluation")
    return text


def write_evaluation(folder: Path, evaluation: Evaluation) -> Manifest:
    """Record ``evaluation`` in ``folder``'s manifest atomically; returns the manifest read back."""
    path = folder / MANIFEST_FILE
    text = manifest_text(folder, evaluation)
    handle, temporary = tempfile.mkstemp(prefix=f".{MANIFEST_FILE}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        # mkstemp makes the file private; the manifest keeps the mode it had
        os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    written = Manifest.read(folder)
    if written.evaluation != evaluation:
        raise ValueError(f"{path}: read back a different evaluation than was written")
    return written


def table(manifest: Manifest, evaluation: Evaluation, device: torch.device, seconds: dict[Precision, float]) -> str:
    """The figures as a small aligned table, with what the manifest recorded before."""
    before = manifest.evaluation.accuracy if manifest.evaluation else {}
    lines = [
        f"{manifest.name}/{manifest.version} on {device}: {evaluation.samples} samples, {evaluation.dataset}",
        f"{'precision':<10} {'accuracy':>8} {'correct':>11} {'before':>8} {'seconds':>8}",
    ]
    for precision, accuracy in evaluation.accuracy.items():
        correct = f"{round(accuracy * evaluation.samples)}/{evaluation.samples}"
        previous = f"{before[precision]:.4f}" if precision in before else "-"
        lines.append(f"{precision:<10} {accuracy:>8.4f} {correct:>11} {previous:>8} {seconds[precision]:>8.2f}")
    for precision in sorted(set(before) - set(evaluation.accuracy)):
        lines.append(
            f"note: the {precision} figure recorded before ({before[precision]:.4f}) is dropped, not measured now"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ai-backend eval``: 0 when measured (and recorded, unless a dry run), 1 when refused."""
    from app.inference.device import resolve_device
    from app.inference.loader import ModelLoadError
    from app.inference.repository import Repository, RepositoryError
    from app.settings import env_name

    parser = argparse.ArgumentParser(prog="ai-backend eval", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", required=True, help="model name")
    parser.add_argument("--version", required=True, help="version to evaluate")
    served = os.environ.get(env_name(("model", "repository")))  # the one the service reads, where it is set
    parser.add_argument(
        "--repository",
        type=Path,
        default=Path(served or "models"),
        help=f"model repository root ({env_name(('model', 'repository'))}, else models)",
    )
    parser.add_argument("--data", type=Path, help="held-out image folder, one subfolder per label")
    parser.add_argument(
        "--precisions", default="auto", help="auto (fp32, and fp16 on CUDA), fp32, fp16 or fp32,fp16; fp32 always runs"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward pass (64)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N held-out images")
    parser.add_argument("--dry-run", action="store_true", help="print the figures, leave the manifest as it is")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        parser.error("need --batch-size >= 1 and --limit >= 1")
    try:  # the names, before any model is read (the device is known later)
        resolve_precisions(args.precisions, torch.device("cpu"))
    except EvaluationError as exc:
        parser.error(str(exc))
    try:
        folder = Repository(args.repository).folder(args.model, args.version)
        manifest = Manifest.read(folder)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise EvaluationError("--device cuda, but CUDA is not available on this machine")
        device = resolve_device(args.device)
        precisions = resolve_precisions(args.precisions, device)
        if warning := slow_precision_warning(precisions, device):
            print(warning, file=sys.stderr)
        limits = _serving_limits()
        heldout = image_folder(args.data, manifest, limits) if args.data else digits_heldout(manifest, limits)
        if args.limit is not None:
            heldout = heldout.first(args.limit)
        evaluation, seconds = evaluate(folder, manifest, heldout, device, precisions, args.batch_size)
        print(table(manifest, evaluation, device, seconds))
        if args.dry_run:
            print(f"dry run: {folder / MANIFEST_FILE} left as it was")
        else:
            write_evaluation(folder, evaluation)
            print(f"recorded in {folder / MANIFEST_FILE}")
    except (EvaluationError, RepositoryError, ModelLoadError, RuntimeError, ValueError, OSError) as exc:
        # OSError: a repository mounted read-only (--dry-run reports without writing)
        print(f"ai-backend eval: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
