"""Runs one batch of one model on the device thread, and survives device faults.

A batch that runs out of device memory is split in halves and each half retried; the
batcher is told the size the device ran it at (padded, where batches are: a batch of 10 padded
to 16 failed at 16), so it caps batch sizes until the pressure passes. A single image that
still does not fit, or a device that fails outright (a CUDA error: the context is lost for
good), is a device failure; so is a head loaded on first use that the device has no memory
for: it loads before the batch runs, and its failure fails the batch once, unsplit (no size
of batch would make it fit, and each half would load it again). After ``fallback_after``
consecutive failures, a configured fallback (the model in fp32 on the CPU) takes over for
good, and the service reports itself degraded; without one, or if it cannot load, each
failure is a 503 ``device_unavailable``. The images a failure leaves uncomputed get that
error; those the device had answered keep their answers (a batch fails as a whole only when
nothing in it was computed).

Before every attempt, the first and each retry, the images whose request has gone (deadline
passed, client disconnected) are left out. A failed attempt's tensors are let go before the
retry: the handler's traceback would keep them, and the device memory with them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from opentelemetry import trace

from app.errors import BatchFailed, DeviceUnavailable, ServiceError, Unavailable
from app.inference.device import DeviceThread, Fault, device_fault, fault_line, release_memory
from app.inference.loader import ModelLoadError
from app.inference.manifest import Manifest
from app.inference.postprocess import TopK
from app.inference.preprocess import Encoded

log = logging.getLogger(__name__)


class Model(Protocol):
    """What the runner needs of a model (``LayeredModel``, or a test double around one)."""

    manifest: Manifest
    device: torch.device
    dtype: torch.dtype

    @property
    def failed_heads(self) -> dict[str, str]: ...

    def batch(self, images: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def batch_rows(self, images: int) -> int: ...

    def head(self, name: str | None = None) -> torch.jit.ScriptModule: ...

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor: ...


class ModelRunner:
    """The batcher's runner for one model: decode (images left encoded for it), stack, forward,
    top-k, all off the event loop."""

    def __init__(
        self,
        model: Model,
        device: DeviceThread,
        top_k: int,
        *,
        on_pressure: Callable[[int], None] = lambda size: None,
        on_fault: Callable[[Fault], None] = lambda fault: None,
        fallback: Callable[[], Model] | None = None,
        fallback_after: int = 3,
        intra_op: int = 0,
        fallback_intra_op: int = 0,
    ) -> None:
        self.model = model
        self._on_fault = on_fault  # called on the device thread, once a failed forward pass
        self._ids = {"model": model.manifest.name, "version": model.manifest.version}  # on its log lines
        self._device = device
        self._k = min(top_k, len(model.manifest.labels))
        self._on_pressure = on_pressure
        self._fallback = fallback
        self._fallback_after = fallback_after
        # torch threads a batch of the model serving now runs with (0: as the thread has them),
        # the fallback's once it takes over: each device thread takes them up at its next batch
        self._intra_op, self._fallback_intra_op = intra_op, fallback_intra_op
        self.failures = 0  # consecutive device failures
        self.degraded = False
        self._failing = threading.Lock()
        self._generation = 0  # which model: one more each time the fallback takes over

    @property
    def generation(self) -> int:
        """Which model serves: one more each time another (the CPU fallback) took over."""
        return self._generation

    async def __call__(
        self,
        images: Sequence[torch.Tensor | Encoded],
        deadlines: Sequence[float] | None = None,
        urgent: bool = False,
        gone: Callable[[int], bool] | None = None,
        ids: Callable[[int], str] | None = None,
        riders: bool = False,
    ) -> list[TopK | ServiceError | None]:
        """Answers in order; ``None`` for an image whose request went before its batch reached
        the device, or before a retry: past its deadline (``time.monotonic()``), or ``gone(i)``
        (its client disconnected). It is not computed (an ``Encoded`` one not decoded). The error
        for an image the device could not compute while it computed others, or that did not
        decode. Urgent batches go first, and one without ``riders`` (normal requests along) has a
        core to itself where normal batches may wait for it (``holding_the_cores``). ``ids(i)``:
        image i's request id, for the log lines about some of them."""
        batch = list(images)
        if urgent and not riders:
            return await self._device.run(lambda: self._alone(batch, deadlines, gone, ids), urgent=True)
        return await self._device.run(lambda: self.run_sync(batch, deadlines, gone, ids), urgent=urgent)

    def _alone(
        self,
        images: list[torch.Tensor | Encoded],
        deadlines: Sequence[float] | None,
        gone: Callable[[int], bool] | None,
        ids: Callable[[int], str] | None,
    ) -> list[TopK | ServiceError | None]:
        with self._device.holding_the_cores():
            return self.run_sync(images, deadlines, gone, ids)

    def run_sync(
        self,
        images: list[torch.Tensor | Encoded],
        deadlines: Sequence[float] | None = None,
        gone: Callable[[int], bool] | None = None,
        ids: Callable[[int], str] | None = None,
    ) -> list[TopK | ServiceError | None]:
        """Blocking: the live images on the device (split on out-of-memory), answers on the host.

        Raises ``DeviceUnavailable`` when the device computed none of them (its ``left_out``: the
        indices not computed because their requests went); otherwise an image it could not
        compute has the error in its place, as has one whose output is not finite. Any other
        error of the first attempt (a bug) is raised with the same ``left_out``: those requests
        are answered for themselves (past their deadline), not with the batch's failure.

        The ``Encoded`` images still wanted are decoded first, here, on the thread that then
        runs them; one that does not decode is answered with its error (a 400 or 413), the
        batch runs without it, and an error raised for the whole batch carries those errors
        in ``refused`` (index to error).

        A traceback logged here for some of the images (a bug in decoding one, or in a part of the
        batch) names their requests' ids (``ids``, when given) in ``request_ids``: their own error
        lines say it is logged with their batch, and with tracing off nothing else joins them."""
        batch = _Batch(images, deadlines, gone, ids)
        self._use_intra_op()
        self._decode(batch)
        generation = self._generation
        self._device.yield_to_urgent()
        try:
            self._compute(batch, range(len(images)), self.model)
        except Exception as exc:  # a bug (or a model that cannot serve) fails the batch: not those it left out
            exc.left_out = tuple(i for i in range(len(images)) if i not in batch.attempted)  # type: ignore[attr-defined]
            exc.refused = dict(batch.refused)  # type: ignore[attr-defined]  # nor those that did not decode
            raise
        if not batch.failed:
            if batch.computed:  # a batch whose requests all went never reached the device: it proves nothing
                self.failures = 0
            return batch.answers
        # several device threads may share this runner: one counts at a time, one falls back
        with self._failing:
            if self._generation != generation:  # another batch's failure brought the fallback meanwhile
                self._use_intra_op()
                self._compute(batch, batch.retry(), self.model, part=True)
            else:
                self.failures += 1
                if self._fallback is not None and self.failures >= self._fallback_after:
                    self._fall_back(batch)  # outside any handler: the failed model is not referenced from one
            if not batch.failed:
                self.failures = 0
                return batch.answers
        error = DeviceUnavailable(batch.reason)
        refused = batch.refused
        if not batch.computed and all(answer is None for i, answer in enumerate(batch.answers) if i not in refused):
            # the rest were left out, uncomputed (gone, or past their deadline), or did not decode
            failed = set(batch.failed)
            error.left_out = tuple(i for i in range(len(images)) if i not in failed and i not in refused)  # type: ignore[attr-defined]
            error.refused = dict(refused)  # type: ignore[attr-defined]
            raise error
        for i in batch.failed:
            batch.answers[i] = error
        return batch.answers

    def _decode(self, batch: _Batch) -> None:
        """Decode the batch's ``Encoded`` images whose requests are still wanted, in place; the
        time it took goes on the batch's span (this thread runs in the batcher's context)."""
        started, decoded, encoded = time.perf_counter(), 0, False
        for i, image in enumerate(batch.images):
            # asked image by image: a request may go while the images before it decode
            if not isinstance(image, Encoded) or not batch.now((i,)):
                continue
            self._device.yield_to_urgent()  # a normal batch: an urgent one running takes the core first
            encoded = True
            try:
                batch.images[i] = image.decode()
                decoded += 1
            except ServiceError as exc:  # the client's image: its request alone is answered so
                batch.refuse(i, exc)
            except Exception as exc:  # a bug in decoding: this image's request gets a generic 500
                log.error("decoding an image of a batch failed", exc_info=exc, extra=self._about(batch, [i]))
                failed = BatchFailed("inference failed")
                failed.__cause__, failed.logged = exc, True
                batch.refuse(i, failed)
        if encoded:
            span = trace.get_current_span()
            span.set_attribute("batch.decoded", decoded)
            span.set_attribute("batch.decode_ms", round((time.perf_counter() - started) * 1000, 3))
            if batch.refused:
                span.set_attribute("batch.refused", len(batch.refused))

    def _compute(self, batch: _Batch, indices: Sequence[int], model: Model, part: bool = False) -> None:
        """Computes what is still wanted of ``indices``; what the device cannot, it marks failed.

        An error that is not the device's (a bug) fails the whole batch, unless ``indices`` is a
        part of it (split off after an out-of-memory error, or retried on the fallback): the rest
        may be answered already, so only this part's images get the error."""
        wanted = batch.now(indices)
        batch.attempted.update(wanted)
        if not wanted:
            return
        if batch.lost:  # a device error earlier in this batch: the context is gone
            batch.fail(wanted, Fault.DEVICE)
            return
        loading = True  # the head first (on its first use it loads): its failure is no batch size's
        try:
            model.head()
            loading = False
            computed = self._forward(model, [batch.tensor(i) for i in wanted])
        except ModelLoadError as exc:  # a head that cannot serve (logged where it failed)
            raise Unavailable("the model cannot serve: a layer failed to load", code="model_unavailable") from exc
        except Exception as exc:
            fault = device_fault(exc)
            if fault is None and not part:
                raise
            if fault is None:
                log.exception(
                    "part of a batch failed on its retry (%d images; split after running out of memory, or "
                    "retried on the CPU fallback)",
                    len(wanted),
                    extra=self._about(batch, wanted),
                )
                failed = BatchFailed("inference failed")
                failed.logged = True  # the traceback above, once for the images of this part
                for i in wanted:
                    batch.answers[i] = failed
                return
            log.warning("%s %s: %s", fault.value, self._where(model, wanted, loading), fault_line(exc), extra=self._ids)
            self._on_fault(fault)
            # on the batch's span (this thread runs in the batcher's context): a split shows in its trace
            event: dict[str, str | int | bool] = {"batch.size": len(wanted), "fault": fault_line(exc)}
            if loading:
                event["head.loading"] = True
            trace.get_current_span().add_event(fault.value, event)
        else:
            for i, top in zip(wanted, computed, strict=True):
                batch.answers[i] = top
            batch.computed += len(wanted)
            return
        # past the handler: the failed attempt's frames, and the tensors they held, are gone
        release_memory(model.device)
        if loading:  # no batch size makes the head fit: split, each half would load it again
            batch.fail(
                wanted, fault, "the device is out of memory for the model's head" if fault is Fault.MEMORY else None
            )
            return
        if fault is Fault.DEVICE or len(wanted) == 1:
            batch.fail(wanted, fault)
            return
        self._on_pressure(model.batch_rows(len(wanted)))  # the size it failed at: a padded batch's, not its images'
        half = len(wanted) // 2
        self._compute(batch, wanted[:half], model, part=True)
        self._compute(batch, wanted[half:], model, part=True)

    def _about(self, batch: _Batch, indices: Sequence[int]) -> dict[str, object]:
        """The fields of a log line about some of a batch's images: the model, and their requests'
        ids where the batch has them."""
        if batch.ids is None:
            return dict(self._ids)
        return {**self._ids, "request_ids": [batch.ids(i) for i in indices]}

    @staticmethod
    def _where(model: Model, wanted: Sequence[int], loading: bool) -> str:
        """Where a device fault struck, for its log line: loading the head, or at a batch size."""
        if loading:
            return "loading the model's head"
        rows = model.batch_rows(len(wanted))
        return f"at batch {len(wanted)}" + (f" (padded to {rows})" if rows != len(wanted) else "")

    def _forward(self, model: Model, images: list[torch.Tensor]) -> list[TopK | ServiceError]:
        with torch.inference_mode():
            # a padded batch's extra rows are zero images: not answers
            probabilities = model.probabilities(model.batch(images))[: len(images)]
            values, indices = probabilities.topk(self._k, dim=1)
            finite = torch.isfinite(probabilities).all(dim=1)
            values, indices, finite = values.cpu(), indices.cpu(), finite.cpu()
        if bool(finite.all()):
            return [TopK(tuple(v), tuple(i)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]
        # NaN or inf (an input the model divides by zero on, an fp16 overflow): not an answer
        log.error(
            "%d of %d images gave a non-finite output", len(images) - int(finite.sum()), len(images), extra=self._ids
        )
        return [
            TopK(tuple(v), tuple(i)) if ok else BatchFailed("the model's output for this image is not finite")
            for v, i, ok in zip(values.tolist(), indices.tolist(), finite.tolist(), strict=True)
        ]

    def _fall_back(self, batch: _Batch) -> None:
        """The CPU fallback takes over for good, and computes what the device could not."""
        assert self._fallback is not None
        log.error(
            "the device failed %d batches in a row: serving from the CPU fallback", self.failures, extra=self._ids
        )
        load, self._fallback = self._fallback, None  # once: there is no fallback from the fallback
        try:
            fallback = load()
        except Exception:
            # it would fail the same way again, seconds on the device thread for every batch
            log.exception("the CPU fallback did not load: the model stays unavailable", extra=self._ids)
            batch.reason = "the device failed, and the CPU fallback could not load"
            return
        failed, self.model = self.model, fallback
        self._generation += 1
        device = failed.device
        self.degraded = True
        del failed  # nothing else holds it (the service reads the runner's model)
        release_memory(device)
        if self._fallback_intra_op and self._fallback_intra_op != self._intra_op:
            log.warning(
                "the CPU fallback runs each batch on %d torch threads (the CPU's plan for this machine; "
                "on the device: %d)",
                self._fallback_intra_op,
                self._intra_op,
                extra=self._ids,
            )
        self._intra_op = self._fallback_intra_op or self._intra_op
        self._use_intra_op()
        self._compute(batch, batch.retry(), fallback, part=True)

    def _use_intra_op(self) -> None:
        """This device thread computes with the torch threads the model serving now wants. Torch
        keeps the count per thread (OpenMP's), so each device thread sets its own; another
        model's batches on the same thread set theirs back."""
        if self._intra_op and torch.get_num_threads() != self._intra_op:
            torch.set_num_threads(self._intra_op)


class _Batch:
    """One batch's images, which of them are still wanted, and how far the device got."""

    def __init__(
        self,
        images: list[torch.Tensor | Encoded],
        deadlines: Sequence[float] | None,
        gone: Callable[[int], bool] | None,
        ids: Callable[[int], str] | None = None,
    ) -> None:
        self.images, self._deadlines, self._gone = images, deadlines, gone
        self.ids = ids  # an image's request id, for log lines, read only there (None: not known)
        self.answers: list[TopK | ServiceError | None] = [None] * len(images)
        self.refused: dict[int, ServiceError] = {}  # the images that did not decode, answered with these errors
        self.computed = 0
        self.attempted: set[int] = set()  # the images sent to the device at least once
        self.failed: list[int] = []
        self.lost = False  # a device error: nothing more runs on this device in this batch
        self.reason = ""

    def now(self, indices: Sequence[int]) -> list[int]:
        now = time.monotonic()
        deadlines, gone, refused = self._deadlines, self._gone, self.refused
        return [
            i
            for i in indices
            if i not in refused and (deadlines is None or deadlines[i] > now) and (gone is None or not gone(i))
        ]

    def refuse(self, index: int, error: ServiceError) -> None:
        """An image that did not decode: its answer is the error, and it is never computed (nor
        counted left out). A whole-batch failure carries it in ``refused``: its request is
        answered with its own error, not the batch's."""
        self.answers[index] = self.refused[index] = error
        self.attempted.add(index)

    def tensor(self, index: int) -> torch.Tensor:
        image = self.images[index]
        assert not isinstance(image, Encoded), "an image still wanted is decoded before any attempt"
        return image

    def fail(self, indices: Sequence[int], fault: Fault, reason: str | None = None) -> None:
        self.failed.extend(indices)
        self.lost = self.lost or fault is Fault.DEVICE
        self.reason = reason or ("the device failed" if self.lost else "the device is out of memory even for one image")

    def retry(self) -> list[int]:
        """The failed images, to try on another device: none has failed there yet."""
        failed, self.failed, self.lost = self.failed, [], False
        return failed
