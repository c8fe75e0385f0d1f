"""Train the bundled model: a small CNN on scikit-learn's handwritten digits.

The data set ships inside scikit-learn, so the service can give right answers out of the
box without downloading anything. Images are the set's own 8x8 pixels (0-16) scaled to
0-255: a light digit on a dark ground. Users send images of any size; the model's input
spec asks the service to crop to the digit, centre it in a square and box-filter ("area")
downsample that to 8x8, which is how the set itself was made from size-normalised 32x32
bitmaps. Training mixes the set's own pixels with copies of them drawn large and passed
through the service's own decoding (``served_copies``), so the model knows the blur and
the framing that a real upload arrives with.

Training is seeded and deterministic, so ``build`` with the same seed on the same
software rebuilds the same weights. The held-out accuracy in the manifest is measured
through ``LayeredModel``, on the files as written, so it is what the served model gets.

scikit-learn is a dev-only dependency: it is imported inside the functions that need it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from app.inference.loader import LayeredModel
from app.inference.manifest import Evaluation, InputSpec, Manifest, Provenance, ResizeSpec, is_valid_version
from app.inference.packaging import write_version

log = logging.getLogger(__name__)

MODEL_NAME = "digits"
HEAD_NAME = "classifier"
LABELS = tuple(str(digit) for digit in range(10))
DATASET = "sklearn.datasets.load_digits"
HELDOUT_FRACTION = 0.2
EPOCHS = 40
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
MAX_SHIFT = 1  # pixels, each way
INTENSITY_RANGE = (0.4, 1.0)
COPIES = 6  # re-photographed copies of each training image, made once before training
NATIVE_SHARE = 0.3  # chance that a training step sees the set's own pixels, not a copy
COPY_SIZES = (32, 256)  # height in pixels of a copy before the service shrinks it back to 8x8
COPY_ASPECT = (2 / 3, 3 / 2)  # width / height of a copy, log-uniform
JPEG_SHARE = 0.25  # of the copies; the rest are PNG
SAMPLE_SIZE = 64  # pixels a side for the sample PNGs, so a person can see them

Images = npt.NDArray[np.uint8]
Labels = npt.NDArray[np.int64]


@dataclass(frozen=True)
class DigitsSplit:
    """The stratified split: uint8 images ``N x 8 x 8`` in 0-255 and int64 labels 0-9."""

    train_images: Images
    train_labels: Labels
    heldout_images: Images
    heldout_labels: Labels
    seed: int
    data_sha256: str

    @property
    def mean(self) -> float:
        """Mean of the training pixels as ``x / 255``: the input normalisation."""
        return float(self.train_images.astype(np.float64).mean() / 255.0)

    @property
    def std(self) -> float:
        """Standard deviation of the training pixels as ``x / 255``."""
        return float(self.train_images.astype(np.float64).std() / 255.0)


def _dataset_sha256(images: Images, labels: Labels) -> str:
    # The bytes hashed are exactly what training sees (uint8 images in C order, then
    # little-endian int64 labels), so a changed scikit-learn copy of the set shows up here.
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(images).tobytes())
    digest.update(np.ascontiguousarray(labels, dtype="<i8").tobytes())
    return digest.hexdigest()


def load_split(seed: int = 0) -> DigitsSplit:
    """The digits set as uint8 images, split 80/20 (stratified) with ``seed``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    # The set's values are integers 0-16; x * 255 / 16 maps them onto the full uint8 range.
    images: Images = np.rint(np.asarray(bunch.images, dtype=np.float64) * 255.0 / 16.0).astype(np.uint8)
    labels: Labels = np.asarray(bunch.target, dtype=np.int64)
    train_x, heldout_x, train_y, heldout_y = train_test_split(
        images, labels, test_size=HELDOUT_FRACTION, random_state=seed, stratify=labels
    )
    return DigitsSplit(
        train_images=np.ascontiguousarray(train_x),
        train_labels=np.ascontiguousarray(train_y),
        heldout_images=np.ascontiguousarray(heldout_x),
        heldout_labels=np.ascontiguousarray(heldout_y),
        seed=seed,
        data_sha256=_dataset_sha256(images, labels),
    )


def input_spec(split: DigitsSplit) -> InputSpec:
    """One channel, 8x8, fit to the content then box-filtered, normalised with the training statistics.

    Every digit in the set spans its 8 rows (the set was size-normalised), so cropping a
    user's image to its content before shrinking it is what makes the two alike.
    """
    return InputSpec(
        channels=1,
        height=8,
        width=8,
        resize=ResizeSpec(mode="fit_content", filter="box"),
        mean=(split.mean,),
        std=(split.std,),
    )


def make_backbone() -> nn.Module:
    """Image ``N x 1 x 8 x 8`` (normalised) to 64 features."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def make_head() -> nn.Module:
    """64 features to 10 logits."""
    return nn.Linear(64, len(LABELS))


def _normalise(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """``N x 8 x 8`` uint8 (or float 0-255) to the ``N x 1 x 8 x 8`` model input."""
    return ((images.float() / 255.0 - mean) / std).unsqueeze(1)


def served_copies(images: Images, spec: InputSpec, seed: int, copies: int = COPIES) -> Images:
    """``N x copies x 8 x 8`` uint8: each image as a user might send it, after the service's decoding.

    A copy is the image drawn large (``COPY_SIZES`` pixels tall, width/height in
    ``COPY_ASPECT``, bilinear, bicubic or nearest), its strokes made thinner or bolder by a
    contrast curve, saved as PNG or JPEG, then decoded by ``app.inference.preprocess.decode``:
    the very path a request takes, so training sees the blur of the round trip and the
    framing of ``fit_content``. Deterministic in ``seed``; a few seconds for the whole set.
    """
    from PIL import Image

    from app.inference.preprocess import ImageLimits, decode

    rng = np.random.default_rng(seed)
    limits = ImageLimits(max_bytes=1 << 24, max_pixels=1 << 20)
    filters = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC, Image.Resampling.NEAREST)
    ramp = np.arange(256, dtype=np.float64)
    out = np.empty((len(images), copies, spec.height, spec.width), dtype=np.uint8)
    for index, pixels in enumerate(images):
        source = Image.fromarray(pixels)
        for copy in range(copies):
            height = int(rng.integers(COPY_SIZES[0], COPY_SIZES[1] + 1))
            width = round(height * np.exp(rng.uniform(*np.log(COPY_ASPECT))))
            large = source.resize((width, height), filters[int(rng.integers(len(filters)))])
            # Values below `low` go dark and those above `low + span` go full: a high
            # `low` thins the strokes, a low one with a short span thickens them.
            low = rng.uniform(0.0, 160.0)
            span = rng.uniform(16.0, 255.0 - low)
            large = large.point(list(np.rint(np.clip((ramp - low) / span, 0.0, 1.0) * 255.0).astype(int)))
            buffer = io.BytesIO()
            if rng.random() < JPEG_SHARE:
                large.convert("RGB").save(buffer, format="JPEG", quality=int(rng.integers(60, 96)))
            else:
                large.save(buffer, format="PNG", compress_level=1)
            out[index, copy] = decode(buffer.getvalue(), spec, limits)[0].numpy()
    return out


def _augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random shifts of up to ``MAX_SHIFT`` pixels and intensity scaling, on 0-255 floats.

    Shifted-in pixels are dark, like the ground, so a shift never wraps a stroke around.
    """
    count, height, width = images.shape
    span = 2 * MAX_SHIFT + 1
    padded = nn.functional.pad(images, (MAX_SHIFT,) * 4)
    rows = torch.randint(0, span, (count,), generator=generator)
    cols = torch.randint(0, span, (count,), generator=generator)
    shifted = torch.empty_like(images)
    for dy in range(span):
        for dx in range(span):
            chosen = (rows == dy) & (cols == dx)
            shifted[chosen] = padded[chosen, dy : dy + height, dx : dx + width]
    low, high = INTENSITY_RANGE
    scale = torch.empty(count, 1, 1).uniform_(low, high, generator=generator)
    return shifted * scale


def _pick(native: torch.Tensor, copies: torch.Tensor, batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """For each index in ``batch``, its native image (``NATIVE_SHARE`` of the time) or a random served copy."""
    which = torch.randint(0, copies.shape[1], (len(batch),), generator=generator)
    chosen = copies[batch, which]
    keep_native = torch.rand(len(batch), generator=generator) < NATIVE_SHARE
    chosen[keep_native] = native[batch[keep_native]]
    return chosen


def _accuracy(predicted: torch.Tensor, labels: Labels) -> float:
    return float((predicted.cpu().numpy() == labels).mean())


def train(
    seed: int = 0, epochs: int = EPOCHS, *, split: DigitsSplit | None = None, copies: int = COPIES
) -> tuple[nn.Module, nn.Module, float]:
    """Train backbone and head with ``seed``; return them (eval mode) and the held-out accuracy.

    ``split`` defaults to ``load_split(seed)``; ``copies`` is how many ``served_copies`` each
    training image gets (fewer train faster and less robustly). The accuracy here comes from
    the eager modules; ``build`` records the one measured through the loader. The caller's
    global RNG, thread count and determinism settings are left as found.
    """
    split = split or load_split(seed)
    mean, std = split.mean, split.std
    train_x = torch.from_numpy(split.train_images).float()
    train_y = torch.from_numpy(split.train_labels)
    served = torch.from_numpy(served_copies(split.train_images, input_spec(split), seed, copies)).float()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            torch.use_deterministic_algorithms(True)
            # One thread: a tiny model gains nothing from more, and a fixed thread count
            # keeps the floating-point summation order, hence the weights, reproducible.
            torch.set_num_threads(1)
            torch.manual_seed(seed)
            generator = torch.Generator().manual_seed(seed)
            backbone, head = make_backbone(), make_head()
            model = nn.Sequential(backbone, head)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=1e-4)
            steps = epochs * -(-len(train_y) // BATCH_SIZE)
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LEARNING_RATE, total_steps=steps)
            loss_fn = nn.CrossEntropyLoss()
            model.train()
            for _ in range(epochs):
                order = torch.randperm(len(train_y), generator=generator)
                for start in range(0, len(order), BATCH_SIZE):
                    batch = order[start : start + BATCH_SIZE]
                    inputs = _normalise(_augment(_pick(train_x, served, batch, generator), generator), mean, std)
                    loss = loss_fn(model(inputs), train_y[batch])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    schedule.step()
            model.eval()
            with torch.inference_mode():
                logits = model(_normalise(torch.from_numpy(split.heldout_images), mean, std))
        finally:
            torch.use_deterministic_algorithms(was_deterministic)
            torch.set_num_threads(threads)
    return backbone, head, _accuracy(logits.argmax(dim=1), split.heldout_labels)


def evaluate_folder(folder: Path, split: DigitsSplit) -> float:
    """Held-out accuracy of the version in ``folder``, through the loader (fp32, CPU, uint8 input)."""
    manifest = Manifest.read(folder)
    model = LayeredModel.load(folder, manifest, torch.device("cpu"), torch.float32)
    images = torch.from_numpy(split.heldout_images).unsqueeze(1)
    with torch.inference_mode():
        predicted = model.probabilities(images).argmax(dim=1)
    return _accuracy(predicted, split.heldout_labels)


def build(root: Path, version: str = "1", seed: int = 0, *, epochs: int = EPOCHS, overwrite: bool = False) -> Path:
    """Train, evaluate through the loader, and write ``root/digits/version``; returns its path."""
    import sklearn

    if not is_valid_version(version):
        raise ValueError(f"invalid version {version!r}: a whole number of 1-9 digits, no leading zero")
    target = root / MODEL_NAME / version
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists (--overwrite replaces it)")
    started = time.perf_counter()
    split = load_split(seed)
    backbone, head, eager_accuracy = train(seed, epochs, split=split)
    seconds = time.perf_counter() - started
    spec = input_spec(split)
    provenance = Provenance(
        source="app.training.digits",
        data_sha256=split.data_sha256,
        seed=seed,
        details={
            "dataset": DATASET,
            "data_hash": "sha256 of uint8 images (N x 8 x 8, C order) then int64 LE labels, whole set",
            "scikit_learn": sklearn.__version__,
            "torch": torch.__version__,
            "split": "sklearn train_test_split, stratified",
            "heldout_fraction": HELDOUT_FRACTION,
            "split_random_state": seed,
            "train_samples": len(split.train_labels),
            "heldout_samples": len(split.heldout_labels),
            "epochs": epochs,
            "augmentation": (
                f"{COPIES} copies per image through preprocess.decode (height U{COPY_SIZES} px, "
                f"aspect {COPY_ASPECT[0]:.2f}-{COPY_ASPECT[1]:.2f} log-uniform, bilinear/bicubic/nearest, "
                "stroke contrast curve, "
                f"JPEG {JPEG_SHARE:.0%}), native {NATIVE_SHARE:.0%}; "
                f"shift <= {MAX_SHIFT} px, intensity x U{INTENSITY_RANGE}"
            ),
        },
    )

    def write(into: Path, evaluation: Evaluation | None, replace: bool) -> Path:
        return write_version(
            into,
            name=MODEL_NAME,
            version=version,
            backbone=backbone,
            heads={HEAD_NAME: head},
            input_spec=spec,
            labels=LABELS,
            provenance=provenance,
            evaluation=evaluation,
            overwrite=replace,
        )

    # The recorded accuracy must be the served model's, so evaluate the written files
    # (frozen, optimised graphs) in a scratch copy first, then write the real version.
    with tempfile.TemporaryDirectory(prefix="digits-eval-") as scratch:
        accuracy = evaluate_folder(write(Path(scratch), None, False), split)
    evaluation = Evaluation(
        dataset=f"{DATASET} held-out split", samples=len(split.heldout_labels), accuracy={"fp32": accuracy}
    )
    folder = write(root, evaluation, overwrite)
    if evaluate_folder(folder, split) != accuracy:
        raise RuntimeError(f"{folder}: accuracy changed between the scratch and the final copy")
    if accuracy != eager_accuracy:
        log.warning("loader accuracy %.4f differs from eager %.4f", accuracy, eager_accuracy)
    log.info("trained %s/%s in %.1f s, held-out accuracy %.4f", MODEL_NAME, version, seconds, accuracy)
    return folder


def write_samples(folder: Path, split: DigitsSplit) -> list[Path]:
    """Write ``folder/digit_<label>.png``: the first held-out image of each class, upscaled.

    Nearest-neighbour upscaling keeps the pixels exact, so a plain box-filter downsample
    to 8x8 gives back the very held-out image (the service also crops to the digit first).
    """
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for digit in range(len(LABELS)):
        index = int(np.flatnonzero(split.heldout_labels == digit)[0])
        image = Image.fromarray(split.heldout_images[index])  # 2-D uint8 array: mode "L"
        path = folder / f"digit_{digit}.png"
        image.resize((SAMPLE_SIZE, SAMPLE_SIZE), Image.Resampling.NEAREST).save(path, optimize=True)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """``train-digits``: build ``<out>/digits/<version>``, and the sample images beside it unless
    they are there already."""
    parser = argparse.ArgumentParser(
        prog="ai-backend train-digits", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--out", type=Path, default=Path("models"), help="model repository root (default: models)")
    parser.add_argument("--version", default="1", help="version folder to write (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the split, initialisation and shuffling")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"training epochs (default: {EPOCHS})")
    parser.add_argument("--overwrite", action="store_true", help="replace the version if it exists")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be 1 or more")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with warnings.catch_warnings():
        # write_version uses TorchScript on purpose: it is the repository's format, a graph file
        # of code only beside safetensors weights (README, "The model repository"); its
        # deprecation notices would only bury the lines this command prints.
        warnings.filterwarnings("ignore", message=r".*torch\.jit.* is deprecated", category=FutureWarning)
        try:
            folder = build(args.out, args.version, args.seed, epochs=args.epochs, overwrite=args.overwrite)
        except (FileExistsError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except ImportError as exc:
            if not (exc.name or "").startswith("sklearn"):
                raise
            print(
                f"error: training needs scikit-learn, a development dependency ({exc}): "
                "install the dev group (uv sync) or pip install scikit-learn",
                file=sys.stderr,
            )
            return 1
    manifest = Manifest.read(folder)
    accuracy = manifest.evaluation.accuracy["fp32"] if manifest.evaluation else float("nan")
    samples_folder = folder.parent / "samples"
    if all((samples_folder / f"digit_{digit}.png").is_file() for digit in range(len(LABELS))):
        # kept: a second version (another seed) would rewrite the samples the README and tests use
        print(f"wrote {folder} (held-out accuracy {accuracy:.4f}); the samples in {samples_folder} are kept")
        return 0
    samples = write_samples(samples_folder, load_split(args.seed))
    print(f"wrote {folder} (held-out accuracy {accuracy:.4f}) and {len(samples)} samples in {samples_folder}")
    return 0
