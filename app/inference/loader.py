"""Layered loading: a version's backbone at start, its heads on first use, exactly once.

Every layer is a TorchScript graph holding code only plus a safetensors file holding
its tensors. Each file is read once into memory, checked against the manifest's sha256, and
built from those same bytes: what is served is what was checked, and owes nothing to the file
afterwards (a memory-mapped file rewritten in place would change the served weights, and one
truncated would kill the process with SIGBUS). The weights are cast on the host (fp16 when
serving on CUDA) and only then moved to the device, put into the graph, and the graph is
frozen and optimised for inference. A graph and weights that do not fit together fail the
self-check with a ``ModelLoadError`` naming the folder, as a corrupt file does.

A layer with convolutions (4-D weights) is served channels-last: its weights and its input batch
laid out N x H x W x C, which oneDNN's convolutions (and cuDNN's tensor cores) run without
reordering every activation, frozen without ``optimize_for_inference`` (whose MKL-DNN layout
reorders at every op that does not take it) and, on the CPU in fp32, run for batches of four or more
as a copy of that graph with every convolution sent to oneDNN (sharing its weights). The exported
mobilenet_v3_small on one CPU thread, batches of 1 to 32 mixed, in alternation in one process: 0.76
of the time a forward pass took before; in the service at saturation (64 clients, 10% urgent, ten
rounds against the commit before, both servers up): the device threads 2.03 against 2.23 ms a
request, 1.069 of its throughput, and 1.035 more with ATen's kernels kept under four images
(docs/performance.md, nineteenth pass). Layers without convolutions (a linear head) are optimised for
inference as before.

Everything here blocks: it runs on the device thread, never on the event loop.
"""

from __future__ import annotations

import io
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from app.inference.device import device_fault
from app.inference.manifest import Layer, Manifest
from app.inference.packaging import sha256_bytes

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A version cannot be served: the message names the file and the problem."""


class FileUnreadable(ModelLoadError):
    """A file missing or unreadable now: perhaps only for now (a volume remounting), so a lazily
    loaded head is tried again on its next use, unlike one whose files were read and are wrong."""


def _read_verified(folder: Path, manifest: Manifest, file: str) -> tuple[Path, bytes]:
    """The file's bytes, read once, if their sha256 is the manifest's."""
    path = folder / file
    if not path.is_file():
        raise FileUnreadable(f"{path}: file is missing")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FileUnreadable(f"{path}: cannot be read ({exc})") from exc
    actual, expected = sha256_bytes(data), manifest.files[file]
    if actual != expected:
        raise ModelLoadError(
            f"{path}: sha256 mismatch (manifest says {expected[:12]}..., file has {actual[:12]}...); "
            "the file is corrupt, truncated or not the one the manifest describes"
        )
    return path, data


def _cannot_run(exc: RuntimeError, folder: Path, what: str) -> Exception:
    """What a self-check's failed run means: the device's fault (out of memory, say) is raised as
    it is, not taken for a model that can never serve; anything else is a graph its weights or
    inputs do not fit, a ``ModelLoadError`` naming the folder and the error's first line
    (TorchScript's runs on with the graph's code)."""
    if device_fault(exc) is not None:
        return exc
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return ModelLoadError(f"{folder}: self-check failed, {what} cannot run: {first}")


def _tensor(output: object, folder: Path, what: str) -> torch.Tensor:
    """A self-check run's output, which must be one tensor (a graph returning a tuple, as some
    torchvision models do in training mode, cannot serve: ``ModelLoadError``, naming the folder)."""
    if not isinstance(output, torch.Tensor):
        raise ModelLoadError(f"{folder}: self-check failed, {what} returns a {type(output).__name__}, not a tensor")
    return output


def _set_tensor(module: torch.jit.ScriptModule, dotted: str, value: torch.Tensor) -> None:
    *path, leaf = dotted.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, leaf, value)


# every 2-D convolution of a frozen graph, as oneDNN's (its arguments in that op's order)
_CONV2D = """
graph(%input, %weight, %bias, %stride, %padding, %dilation, %groups):
    %out = aten::conv2d(%input, %weight, %bias, %stride, %padding, %dilation, %groups)
    return (%out)"""
_ONEDNN_CONV2D = """
graph(%input, %weight, %bias, %stride, %padding, %dilation, %groups):
    %out = aten::mkldnn_convolution(%input, %weight, %bias, %padding, %stride, %dilation, %groups)
    return (%out)"""


def _nodes(block: torch._C.Graph | torch._C.Block) -> Iterator[torch._C.Node]:
    """Every node of a graph, those in nested blocks (an ``if``'s branches, a loop's body) included."""
    for node in block.nodes():
        yield node
        for inner in node.blocks():
            yield from _nodes(inner)


ONEDNN_FROM_BATCH = 4  # below it ATen's kernels, from it oneDNN's (mobilenet_v3_small: they cross at 3)


def _convolutions_by_onednn(frozen: torch.jit.ScriptModule, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The frozen graph again, with every convolution run by oneDNN whatever the batch size; the
    copy shares the graph's tensors (its weights), so it costs no memory. None when it cannot be.

    On one thread, ATen sends a 1x1 convolution of a batch under 16 to its own im2col and
    matrix-multiply path instead (faster once, for N x C x H x W tensors): channels-last, that
    path copies each activation to that layout and back, and cost the exported mobilenet_v3_small
    1.13 times its old time at batches of 2 to 15, where oneDNN's takes 0.66-0.85 of it. Under
    ``ONEDNN_FROM_BATCH`` images ATen's choice is the faster (oneDNN's kernels for the
    squeeze-excitation 1x1s of one image cost more: 3.78 against 2.89 ms an image alone), so the
    frozen graph serves those. A graph the rewrite cannot take keeps ATen's choice, as does one with
    a convolution padded by name (``padding="same"``): oneDNN's op takes only explicit padding."""
    graph = frozen.graph.copy()
    convolutions = [node for node in _nodes(graph) if node.kind() == "aten::conv2d"]
    if not convolutions or any(not isinstance(node.inputsAt(4).type(), torch._C.ListType) for node in convolutions):
        return None
    if next(iter(graph.inputs())).uses():  # frozen, the module itself is no longer read: it cannot be
        return None
    try:
        graph.eraseInput(0)
        torch._C._jit_pass_custom_pattern_based_rewrite_graph(_CONV2D, _ONEDNN_CONV2D, graph)
        return torch._C._create_function_from_graph(f"{name}_onednn", graph)
    except RuntimeError:
        log.warning("the convolutions of %s keep ATen's choice of kernel", name)
        return None


@dataclass(frozen=True)
class PreparedLayer:
    """A layer ready to run, and whether it takes its input channels-last (it has convolutions)."""

    module: torch.jit.ScriptModule
    channels_last: bool
    batched: Callable[[torch.Tensor], torch.Tensor] | None = None  # the module by oneDNN, for larger batches


def load_layer(
    folder: Path, manifest: Manifest, layer: Layer, device: torch.device, dtype: torch.dtype
) -> PreparedLayer:
    """Verify, read and prepare one layer; raises ``ModelLoadError`` naming the bad file."""
    graph_path, graph_bytes = _read_verified(folder, manifest, layer.graph)
    weights_path, weights_bytes = _read_verified(folder, manifest, layer.weights)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "torch.jit.load is deprecated"
            graph = torch.jit.load(io.BytesIO(graph_bytes), map_location="cpu")  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ModelLoadError(f"{graph_path}: not a loadable TorchScript graph ({exc})") from exc
    try:
        weights = load_safetensors(weights_bytes)  # tensors of their own: no file mapped
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{weights_path}: not a readable safetensors file ({exc})") from exc
    del graph_bytes, weights_bytes

    expected = set(graph.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{weights_path}: does not match {graph_path.name} (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    convolutional = any(tensor.dim() == 4 and tensor.is_floating_point() for tensor in weights.values())
    for key, tensor in weights.items():
        # cast on the host, before the copy to the device
        host = tensor.to(dtype) if tensor.is_floating_point() else tensor
        if convolutional and host.dim() == 4:
            host = host.contiguous(memory_format=torch.channels_last)
        _set_tensor(graph, key, host.to(device))
    graph.eval()
    with warnings.catch_warnings():
        # freeze and optimize_for_inference warn that they are deprecated; they still
        # make CPU inference several times faster, which nothing else here does.
        warnings.simplefilter("ignore")
        frozen: torch.jit.ScriptModule = torch.jit.freeze(graph)
        if convolutional:  # channels-last convolutions run faster as frozen than as MKL-DNN's
            batched = None
            if device.type == "cpu" and dtype == torch.float32:  # oneDNN's half precision needs CPU support
                batched = _convolutions_by_onednn(frozen, layer.name)
            return PreparedLayer(frozen, channels_last=True, batched=batched)
        try:
            optimized: torch.jit.ScriptModule = torch.jit.optimize_for_inference(frozen)
            return PreparedLayer(optimized, channels_last=False)
        except Exception:  # some graphs (or devices) reject the extra passes
            log.warning("optimize_for_inference failed for %s; serving the frozen graph", layer.name)
            return PreparedLayer(frozen, channels_last=False)


def padded_size(size: int, largest: int) -> int:
    """The size a batch of ``size`` runs at when padded: the next power of two, or ``largest``
    (the biggest batch the policy allows) where that is smaller; ``size`` itself from ``largest`` up.

    On CUDA each new batch shape costs cuDNN's set-up once, about a second of host CPU for
    mobilenet_v3_small on an H200 (its convolutions' plans are built per shape, then cached),
    and a batcher sends every size from 1 to its max: served unpadded, 116 requests/s where
    the device runs 31,000 images/s. Padded, the device sees at most log2(max) + 1 shapes, all
    of them run by the warm-up; the padding costs device time, at most twice the batch's.
    """
    if size >= largest:
        return size
    return min(1 << (size - 1).bit_length(), largest)


def _stacked(images: list[torch.Tensor], size: int) -> torch.Tensor:
    """``images`` stacked into a new tensor of ``size`` rows, those past them zero."""
    if size == len(images):
        return torch.stack(images)
    first = images[0]
    stacked = torch.empty((size, *first.shape), dtype=first.dtype)
    torch.stack(images, out=stacked[: len(images)])
    stacked[len(images) :].zero_()
    return stacked


@dataclass
class LayeredModel:
    """One loaded model version: normalisation, a backbone and lazily loaded heads."""

    folder: Path
    manifest: Manifest
    device: torch.device
    dtype: torch.dtype
    backbone: torch.jit.ScriptModule
    _scale: torch.Tensor
    _shift: torch.Tensor
    channels_last: bool = False  # the backbone takes its batch laid out N x H x W x C
    # the backbone with every convolution by oneDNN, for batches of ONEDNN_FROM_BATCH or more (the CPU)
    batched_backbone: Callable[[torch.Tensor], torch.Tensor] | None = None
    _heads: dict[str, torch.jit.ScriptModule] = field(default_factory=dict)
    _failed: dict[str, str] = field(default_factory=dict)  # why heads did not load: not tried again
    _unreadable: dict[str, str] = field(default_factory=dict)  # heads whose files could not be read: tried again
    _lock: threading.Lock = field(default_factory=threading.Lock)
    head_loads: int = 0
    # set: batches are padded to a few sizes (``padded_size``) up to the largest batch the policy
    # allows now (read at each batch: a policy change moves it)
    largest_batch: Callable[[], int] | None = None
    warmed: set[int] = field(default_factory=set)  # the batch sizes its warm-ups ran

    @classmethod
    def load(cls, folder: Path, manifest: Manifest, device: torch.device, dtype: torch.dtype) -> LayeredModel:
        """Load the backbone now; heads wait for their first use (or ``load_all_heads``).

        Every head's files are checksummed now too, so a corrupt head stops start-up
        instead of failing its first requests.
        """
        backbone = load_layer(folder, manifest, manifest.backbone, device, dtype)
        for head in manifest.heads:
            _read_verified(folder, manifest, head.graph)
            _read_verified(folder, manifest, head.weights)
        spec = manifest.input
        std = torch.tensor(spec.std, dtype=torch.float32).view(1, -1, 1, 1)
        mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, -1, 1, 1)
        # (x / 255 - mean) / std as one multiply-add on the uint8 batch
        scale, shift = (1.0 / (255.0 * std)), (-mean / std)
        return cls(
            folder,
            manifest,
            device,
            dtype,
            backbone.module,
            scale.to(device),
            shift.to(device),
            backbone.channels_last,
            backbone.batched,
        )

    @property
    def default_head(self) -> str:
        return self.manifest.heads[0].name

    @property
    def loaded_heads(self) -> tuple[str, ...]:
        return tuple(self._heads)

    @property
    def failed_heads(self) -> dict[str, str]:
        """Heads that could not load or run, and why (not tried again: their requests get 503)."""
        return dict(self._failed)

    @property
    def unreadable_heads(self) -> dict[str, str]:
        """Heads whose files could not be read at their last try, and why (tried again on their
        next use: their requests get 503 until one succeeds)."""
        return dict(self._unreadable)

    def head(self, name: str | None = None) -> torch.jit.ScriptModule:
        """The named head, loaded on first use exactly once even under concurrent callers.

        A head that fails to load or its self-check raises ``ModelLoadError``, then and on
        every later use, without loading it again (seconds on the device thread each time);
        one whose files cannot be read now (``FileUnreadable``) is tried again on its next use."""
        name = name or self.default_head
        head = self._heads.get(name)
        if head is not None:
            return head
        with self._lock:
            head = self._heads.get(name)
            if head is None:
                if (failed := self._failed.get(name)) is not None:
                    # a fresh error each time: one kept and raised again would keep every
                    # failing batch's frames, and their tensors, in its growing traceback
                    raise ModelLoadError(failed)
                layer = next((h for h in self.manifest.heads if h.name == name), None)
                if layer is None:
                    raise KeyError(name)
                try:
                    head = load_layer(self.folder, self.manifest, layer, self.device, self.dtype).module
                    with torch.inference_mode():
                        self._check_head(name, head, self._checked_features(self.dummy_batch(2)))
                except FileUnreadable as exc:  # tried again on its next use
                    self._unreadable[name] = str(exc)
                    log.error(
                        "head %s of %s/%s cannot load now: %s", name, self.manifest.name, self.manifest.version, exc
                    )
                    raise
                except ModelLoadError as exc:
                    # its text only: the error itself would keep this batch's frames alive
                    self._failed[name] = reason = str(exc)
                    self._unreadable.pop(name, None)  # read this time: that reason is no longer the one
                    log.error(
                        "head %s of %s/%s cannot serve: %s", name, self.manifest.name, self.manifest.version, reason
                    )
                    raise
                self._heads[name] = head
                self._unreadable.pop(name, None)
                self.head_loads += 1
                log.info("loaded head %s of %s/%s", name, self.manifest.name, self.manifest.version)
        return head

    def load_all_heads(self) -> None:
        for layer in self.manifest.heads:
            self.head(layer.name)

    def batch(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """``C x H x W`` images as one ``N x C x H x W`` batch laid out as the backbone takes it:
        ``N x H x W x C`` when channels-last (decoded images are laid out ``H x W x C``: each is
        copied once, in order), else ``N x C x H x W``. Padded with zero images to
        ``padded_size`` when ``largest_batch`` is set: the first ``len(images)`` rows are theirs."""
        size = self.batch_rows(len(images))
        if self.channels_last:
            laid_out = [image.permute(1, 2, 0) for image in images]
            return _stacked(laid_out, size).permute(0, 3, 1, 2)
        return _stacked(list(images), size)

    def batch_rows(self, images: int) -> int:
        """The rows a batch of ``images`` runs at on the device: more where batches are padded. A
        batch that runs out of memory failed at this size, not at its count of images."""
        return images if self.largest_batch is None else padded_size(images, self.largest_batch())

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Backbone features of a ``N x C x H x W`` uint8 batch."""
        x = images.to(self.device, non_blocking=True)
        if self.channels_last and x.dim() == 4:
            x = self._normalised_channels_last(x)
        else:
            x = x.float().mul_(self._scale).add_(self._shift)
        backbone: Callable[[torch.Tensor], torch.Tensor] = self.backbone
        if self.batched_backbone is not None and x.dim() == 4 and x.shape[0] >= ONEDNN_FROM_BATCH:
            backbone = self.batched_backbone
        return backbone(x.to(self.dtype))

    def _normalised_channels_last(self, images: torch.Tensor) -> torch.Tensor:
        """The uint8 batch normalised, laid out N x H x W x C (its N x C x H x W view returned).

        The layout changes on the uint8 batch (a quarter of the float's bytes), and each image
        row is then normalised as one run of W x C values against the per-channel factors
        repeated W times: broadcast per channel over a channels-last tensor, the same multiply-add
        ran an inner loop of C = 3 values and cost five times as much."""
        n, c, h, w = images.shape
        rows = images.permute(0, 2, 3, 1).contiguous().view(n * h, w * c)  # no copy if channels-last already
        normalised = rows.float().mul_(self._scale.view(c).repeat(w)).add_(self._shift.view(c).repeat(w))
        return normalised.view(n, h, w, c).permute(0, 3, 1, 2)

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        """Class probabilities (fp32) for a uint8 batch."""
        logits = self.head(head)(self.features(images))
        return torch.softmax(logits.float(), dim=1)

    def dummy_batch(self, size: int) -> torch.Tensor:
        spec = self.manifest.input
        generator = torch.Generator().manual_seed(0)
        return torch.randint(
            0, 256, (size, spec.channels, spec.height, spec.width), dtype=torch.uint8, generator=generator
        )

    def self_check(self, batch_size: int = 2) -> None:
        """A dummy batch through backbone and every loaded head: right shape, finite values."""
        with torch.inference_mode():
            features = self._checked_features(self.dummy_batch(batch_size))
            for name, head in self._heads.items():
                self._check_head(name, head, features)

    def _checked_features(self, batch: torch.Tensor) -> torch.Tensor:
        """The backbone's features of a dummy batch, finite; a graph its weights do not fit
        (a shape, a dtype) raises ``ModelLoadError`` here, naming the folder."""
        try:
            output = self.features(batch)
        except RuntimeError as exc:
            raise _cannot_run(exc, self.folder, "the backbone") from None
        features = _tensor(output, self.folder, "the backbone")
        if not torch.isfinite(features).all():
            raise ModelLoadError(f"{self.folder}: self-check failed, backbone output is not finite")
        return features

    def _check_head(self, name: str, head: torch.jit.ScriptModule, features: torch.Tensor) -> None:
        try:
            output = head(features)
        except RuntimeError as exc:  # its weights, or the backbone's features, do not fit its graph
            raise _cannot_run(exc, self.folder, f"head {name}") from None
        logits = _tensor(output, self.folder, f"head {name}")
        expected = (features.shape[0], len(self.manifest.labels))
        if tuple(logits.shape) != expected:
            raise ModelLoadError(
                f"{self.folder}: self-check failed, head {name} gives shape {tuple(logits.shape)}, expected {expected}"
            )
        if not torch.isfinite(logits).all():
            raise ModelLoadError(f"{self.folder}: self-check failed, head {name} output is not finite")

    def warm_up_sizes(self, max_batch: int) -> list[int]:
        """The batch sizes a warm-up runs: every padded size when batches are padded (each new
        shape costs the device its set-up once), else the smallest, the largest and one between."""
        if self.largest_batch is not None:
            return sorted({padded_size(n, max_batch) for n in range(1, max_batch + 1)})
        return sorted({1, max(1, max_batch // 2), max_batch})

    def warm_up(self, max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None) -> None:
        """Run the batch sizes serving will see (``sizes``: some of them), so the first requests
        pay no compilation and no load: the default head, which every request uses, is loaded
        (and checked) first; the others stay lazy."""
        self.head()
        sizes = self.warm_up_sizes(max_batch) if sizes is None else sizes
        with torch.inference_mode():
            for size in sizes:
                batch = self.dummy_batch(size)
                for _ in range(rounds):
                    features = self.features(batch)
                    for head in list(self._heads.values()):  # another thread may load one meanwhile
                        head(features)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmed.update(sizes)
