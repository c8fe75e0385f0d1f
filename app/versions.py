"""A model version's way onto the device: read, checked and warmed on a loader thread of its
own, within ``model.load_timeout_s``, then served by a runner and a batcher of its own.

A load the device fails while serving (out of memory beside the versions already loaded, say)
is a 503 ``device_unavailable``, with what it took released; at start-up it fails start-up with
the device's own line (and, out of memory in the warm-up, the max batch to lower). One its
files or graph refuse, or whose warm-up fails other than by the device, is a ``ModelLoadError``;
one past its timeout keeps running on the loader thread (a thread cannot be stopped) and no other
load starts until it ends. One load runs at a time: another asked for meanwhile is a 503
``model_loading`` with ``Retry-After``, not a call queued behind it with its timeout running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import torch
from opentelemetry import trace

from app.batching import BatchPolicy, DualWindowBatcher, LanePolicy
from app.errors import DeviceUnavailable, Unavailable
from app.inference.bounded import BoundedCall
from app.inference.device import DeviceThread, Fault, Threads, device_fault, dtype_name, fault_line, release_memory
from app.inference.jobs import Answer, Job, TracedRunner, reached_the_device
from app.inference.loader import LayeredModel, ModelLoadError
from app.inference.repository import Repository
from app.inference.runner import ModelRunner
from app.inference.workers import WorkerThreads
from app.settings import BatchingSettings, LaneSettings, Settings, env_name
from app.telemetry.metrics import BatchMetrics, Metrics

log = logging.getLogger(__name__)


def batch_policy(settings: BatchingSettings) -> BatchPolicy:
    """The batcher's policy from the settings (milliseconds to seconds)."""

    def lane(s: LaneSettings) -> LanePolicy:
        return LanePolicy(s.window_ms / 1000.0, s.max_batch, s.max_queue)

    return BatchPolicy(
        lane(settings.urgent),
        lane(settings.normal),
        settings.urgent_fill,
        settings.admission_headroom,
        settings.urgent_fill_backlog,
    )


@dataclass(eq=False)
class ServedModel:
    """A loaded model version with its own batcher."""

    name: str
    version: str
    runner: ModelRunner
    batcher: DualWindowBatcher[Job, Answer]
    load_s: float
    metrics: BatchMetrics  # its own series, removed when it is unloaded

    @property
    def model(self) -> LayeredModel:
        """The model that serves now: the runner's, which its CPU fallback replaces (no other
        reference may keep a failed device's model, and its memory, alive)."""
        return cast(LayeredModel, self.runner.model)

    @property
    def labels(self) -> tuple[str, ...]:
        return self.model.manifest.labels


class VersionLoader:
    """Loads model versions for the service: each on the loader thread, checked and warmed on
    the device threads, with its runner and batcher built. ``policy`` says the batching policy
    in force (the warm-up runs its largest batch; a new batcher starts with it); ``release``
    frees what unloaded or failed versions held."""

    def __init__(
        self,
        settings: Settings,
        repository: Repository,
        device: torch.device,
        dtype: torch.dtype,
        threads: Threads,
        device_thread: DeviceThread,
        metrics: Metrics,
        tracer: trace.Tracer,
        policy: Callable[[], BatchPolicy],
        release: Callable[[], Awaitable[None]],
        fallback_intra_op: int = 0,
    ) -> None:
        self.settings, self.repository, self.device, self.dtype = settings, repository, device, dtype
        self.threads, self._device_thread = threads, device_thread
        self._fallback_intra_op = fallback_intra_op  # torch threads a batch gets on the CPU fallback
        self.metrics, self.tracer = metrics, tracer
        self._policy, self._release = policy, release
        # loads given up (past their timeout, or cancelled) still running on the loader thread: why
        self._late_loads: dict[str, str] = {}
        # the load under way (its read, checks and warm-up, or a head loaded for a promotion), with
        # its ``perf_counter`` at the start: one at a time, as the loader has one thread
        self._under_way: dict[str, float] = {}
        # loads read, checksum, build and self-check a version on a thread of their own: on the
        # device's (a GPU has one) a version loaded while serving held every batch for seconds.
        # Where normal batches run niced (a CPU with an urgent thread), a load is as low: it must
        # not take an urgent batch's core either
        self._loader = WorkerThreads("loader", nice=threads.normal_nice if threads.urgent else 0)
        # whether a version's batches up to a size may run (warmed), its memory ceiling rising to
        # it; the service's background warm-up answers (``Rewarmer.ready``)
        self.sizes_ready: Callable[[str, str, int], bool] = lambda _name, _version, _size: True

    def close(self, timeout_s: float) -> list[str]:
        """Stop the loader thread (blocks: call it off the loop); its name if a load outlasted the
        join of ``timeout_s``."""
        return self._loader.close(timeout_s)

    @property
    def late_loads(self) -> list[str]:
        """``name/version`` of the loads past their timeout that still run on the loader thread."""
        return sorted(self._late_loads)

    def _late_load_ended(self, label: str, started: float, dropped: bool = True) -> None:
        """On the loop, once a late load ends (``started``: its ``perf_counter`` at the start;
        ``dropped``: what it loaded is dropped, a version, not kept, a head)."""
        log.warning(
            "the load of %s, %s, ended %.1fs after it began%s",
            label,
            self._late_loads.pop(label, "given up"),
            time.perf_counter() - started,
            "; what it loaded was dropped" if dropped else "",
        )

    async def _device_failed(
        self, label: str, fault: Fault, line: str, *, warming: bool, serving: bool
    ) -> DeviceUnavailable | ModelLoadError:
        """A load the device failed: the memory it took released, and the error to raise (any
        other error is a bug: 500). While serving, a 503 ``device_unavailable``: out of memory
        beside the versions already loaded, say, which a later try may find freed. At start-up,
        a ``ModelLoadError`` naming the device's own line, and for memory the warm-up ran out of,
        the setting to lower: another start would fail the same way. Called once the error is
        handled and gone: its traceback held the model's frames, and with them the memory to release."""
        await self._release()  # the model sits in reference cycles: collected, then released
        if not serving:
            return ModelLoadError(self._start_up_fault(label, fault, line, warming))
        log.error("loading %s: the device failed (%s): %s", label, fault.value, line)
        return DeviceUnavailable(f"loading {label}: the device failed ({fault.value}); try again later")

    def _start_up_fault(self, label: str, fault: Fault, line: str, warming: bool) -> str:
        """Why start-up failed, when the device failed a version's load or its warm-up."""
        where = f"loading {label} on {self.device}"
        if fault is Fault.DEVICE:
            return f"{where}: the device failed: {line}"
        if not warming:
            return f"{where}: out of memory for the model itself, beside what the device holds already: {line}"
        policy = self._policy()
        biggest = policy.largest_batch  # the warm-up runs batches up to it: the lanes allowing it set it
        lanes = [
            name for name, lane in (("normal", policy.normal), ("urgent", policy.urgent)) if lane.max_batch >= biggest
        ]
        lower = " and ".join(
            f"batching.{lane}.max_batch ({env_name(('batching', lane, 'max_batch'))})" for lane in lanes
        )
        return (
            f"{where}: out of memory in the start-up warm-up, which runs batches of up to {biggest} images: "
            f"lower {lower}, now {biggest}. The device said: {line}"
        )

    def _pads(self, device: torch.device) -> bool:
        """Whether batches on ``device`` are padded to a few sizes (``model.pad_batches``)."""
        setting = self.settings.model.pad_batches
        return setting == "on" or (setting == "auto" and device.type == "cuda")

    def unwarmed_shapes_warning(self, device: torch.device) -> str | None:
        """What serving with ``model.warmup`` off costs on ``device``, when it costs more than a slow
        first batch: on CUDA each batch size is first set up while serving, the batches behind it
        held; and on an H200 a real out-of-memory during such a set-up crashed the process when that
        size ran again (the warm-up sets every size up before serving, while memory is there)."""
        if self.settings.model.warmup or device.type != "cuda":
            return None
        return (
            f"model.warmup is off on {device}: each batch size is set up by its first batch while serving "
            "(about a second of host CPU, every batch behind it held), and a size first set up under "
            "memory pressure has crashed the process when it ran again; set AI_SERVICE_MODEL__WARMUP=true"
        )

    def _largest_batch(self) -> int:
        """The biggest batch the policy in force allows: padded batches go no bigger."""
        return self._policy().largest_batch

    async def _warm_up(self, model: LayeredModel, every_thread: bool) -> None:
        """Run the batch sizes serving will see. Before serving, on every device thread: each
        keeps its own allocator arena, grown to the largest batch it has run, and warmed on one
        the others grew under the first heavy load instead (mobilenet_v3_small at batch 32: 750
        MiB resident once ready, 960 once the other two threads had run a batch of 32). A version
        loaded while serving warms one batch size a call (the arenas are grown by then), so the
        batches queued meanwhile run between them, urgent ones first: a GPU has one thread."""
        biggest = self._largest_batch()
        if every_thread:
            # a size a call, on each thread at once: a start-up stopped meanwhile (a SIGTERM, a
            # Ctrl-C) waits for the size under way, not for the rest of the warm-up (seconds a
            # shape on a GPU), which no request would ever use
            for size in model.warm_up_sizes(biggest):
                await self._device_thread.run_on_each(functools.partial(model.warm_up, biggest, sizes=(size,)))
            return
        for size in model.warm_up_sizes(biggest):
            await self.warm_size(model, size)

    def unwarmed_size(self, model: LayeredModel, upto: int | None = None) -> int | None:
        """The smallest size a warm-up under the policy now in force would run that ``model`` has
        not run (``upto``: of those up to it); None when there is none, or warm-ups are off.
        Without it the first batch at a new size pays the device's set-up for that shape: about a
        second of host CPU on CUDA, holding every batch behind it."""
        if not self.settings.model.warmup:
            return None
        sizes = model.warm_up_sizes(self._largest_batch())
        limit = sizes[-1] if upto is None else upto
        return next((size for size in sizes if size not in model.warmed and size <= limit), None)

    async def load_head(self, model: LayeredModel) -> None:
        """``model``'s default head loaded, if it was not yet, on the loader thread: as a version's
        load, at its priority and not on a device thread a batch waits for. Loaded already (the
        warm-up loads it), nothing runs; while another load holds the loader, a 503
        ``model_loading`` rather than a wait behind it; past ``model.load_timeout_s``, a 503
        ``model_loading`` too, the head a late load until it ends; the device failing it, a 503
        ``device_unavailable``. A head its files or graph refuse raises ``ModelLoadError``."""
        if model.default_head in model.loaded_heads:
            return
        label = f"{model.manifest.name}/{model.manifest.version}"
        head = f"the head of {label}"
        done = self._claim(head)
        started = time.perf_counter()
        # the model keeps a head loaded late: nothing to drop or release when it ends
        bounded = BoundedCall(
            model.head, on_late_end=functools.partial(self._late_load_ended, head, started, dropped=False)
        )
        why = "given up: the promotion that asked for it went away"  # why it is given up, if it is
        failed: tuple[Fault, str] | None = None
        try:
            await bounded.run(self._loader, self.settings.model.load_timeout_s)
        except TimeoutError:
            # its read hangs (a stalled network mount, say): a late load as any other (``/healthz``)
            why = f"given up after model.load_timeout_s={self.settings.model.load_timeout_s:g}s"
            raise _loading(
                f"{self._too_long(head)}; it goes on on the loader thread, try again once it ends",
                self.settings.model.load_timeout_s,
            ) from None
        except Exception as exc:
            if (fault := device_fault(exc)) is None:
                raise
            failed = fault, fault_line(exc)  # handled: its traceback, holding what the load allocated, goes
        finally:
            done()
            if bounded.late:  # a thread cannot be stopped: the loader is held until it ends
                self._late_loads[head] = why
        if failed is not None:
            raise await self._device_failed(label, *failed, warming=False, serving=True)

    def _too_long(self, what: str, how: str = "") -> str:
        """Why a load (``what``: its folder, a head) was given up at ``model.load_timeout_s``."""
        timeout = self.settings.model.load_timeout_s
        variable = env_name(("model", "load_timeout_s"))
        return f"loading {what} took longer than model.load_timeout_s={timeout:g}s{how} ({variable})"

    def _claim(self, label: str) -> Callable[[], object]:
        """The loader for ``label`` alone until the returned call says it is done. Another load,
        or one past its timeout that still runs, is a 503 ``model_loading``: a call queued behind
        it would wait for a thread it cannot know the end of (a load timed out while it waited,
        and was answered 409 ``model_load_failed``, blaming a version that was never tried)."""
        timeout = self.settings.model.load_timeout_s
        if self._late_loads:
            raise _loading(
                f"loading {', '.join(self.late_loads)} passed model.load_timeout_s and still runs on "
                "the loader thread; another load can start once it ends",
                timeout,
            )
        if self._under_way:
            other, began = next(iter(self._under_way.items()))
            raise _loading(
                f"loading {other} is under way; one load runs at a time, try again once it ends",
                timeout - (time.perf_counter() - began),
            )
        self._under_way[label] = time.perf_counter()
        return functools.partial(self._under_way.pop, label, None)

    async def warm_size(self, model: LayeredModel, size: int) -> None:
        """One warm-up batch size, one device call: batches queued meanwhile run before or after it."""
        await self._device_thread.run(functools.partial(model.warm_up, self._largest_batch(), sizes=(size,)))

    async def _warmed(
        self, model: LayeredModel, every_thread: bool, within_s: float | None
    ) -> tuple[Fault, str] | str | None:
        """Warm ``model`` up within ``within_s`` (None: however long it takes); the device's
        failure (its fault and line) if the device failed it, else why the version is refused:
        it ran late, or its graph failed a batch size."""
        # a load's phases on the span of the call that asked for it (an admin load; start-up has none)
        trace.get_current_span().add_event("model read and checked", {"model.version": model.manifest.version})
        started = time.perf_counter()
        try:
            async with asyncio.timeout(within_s):
                await self._warm_up(model, every_thread)
        except TimeoutError:
            return self._too_long(str(model.folder), " with its warm-up")
        except Exception as exc:
            if (fault := device_fault(exc)) is not None:
                return fault, fault_line(exc)
            if not isinstance(exc, RuntimeError | ValueError):
                raise  # a bug of ours: a 500
            # the graph cannot run a batch size the self-check does not run (TorchScript raises a
            # RuntimeError): the version's fault, as a failed self-check is. Its text only: the
            # error's traceback holds the model, whose memory is released next
            return f"{model.folder}: its warm-up failed: {_what_failed(exc)}"
        trace.get_current_span().add_event("model warmed", {"seconds": _since(started)})
        return None

    async def _load_model(self, name: str, version: str, started: float, every_thread: bool) -> LayeredModel:
        """Load, check and warm one version's model, within ``model.load_timeout_s`` counted from
        ``started``: it runs at once, as no other load runs meanwhile (``_claim``)."""
        done = self._claim(f"{name}/{version}")
        try:
            return await self._load_alone(name, version, started, every_thread)
        finally:
            done()

    async def _load_alone(self, name: str, version: str, started: float, every_thread: bool) -> LayeredModel:
        folder = self.repository.folder(name, version)
        timeout = self.settings.model.load_timeout_s

        def load() -> LayeredModel:
            manifest = self.repository.manifest(name, version)
            model = LayeredModel.load(folder, manifest, self.device, self.dtype)
            if self._pads(self.device):
                model.largest_batch = self._largest_batch
            if self.settings.model.eager_heads:
                model.load_all_heads()
            elif self.settings.model.warmup:  # the warm-up's first use: here, not on a device thread
                model.head()
            model.self_check()
            return model

        label = f"{name}/{version}"
        if (warning := self.unwarmed_shapes_warning(self.device)) is not None:
            log.warning("%s: %s", label, warning)
        bounded = BoundedCall(
            load,
            release=functools.partial(release_memory, self.device),
            on_late_end=functools.partial(self._late_load_ended, label, started),
        )
        why = "cancelled as start-up stopped"  # why it is given up, if it is
        failed: tuple[Fault, str] | str | None = None  # the device failed it, or it ran late: released after the error
        refused: str | None = None  # its files or graph refused it: on a GPU, what it moved there is released
        try:
            model = await bounded.run(self._loader, timeout)
        except TimeoutError as exc:
            why = f"given up after model.load_timeout_s={timeout:g}s"
            raise ModelLoadError(self._too_long(str(folder))) from exc
        except (ModelLoadError, ValueError) as exc:  # a bad file, graph or manifest
            refused = str(exc)
        except Exception as exc:
            if (fault := device_fault(exc)) is None:
                raise
            failed = fault, fault_line(exc)
        finally:
            if bounded.late:  # timed out or cancelled: a thread cannot be stopped, it ends when it ends
                self._late_loads[label] = why
        if refused is not None:
            await self._release()  # the error, whose frames held what it built, is gone by now
            raise ModelLoadError(refused)
        warming = failed is None and self.settings.model.warmup
        if warming:
            # while serving, the warm-up counts in the load's time (a graph that crawls at the sizes
            # the self-check does not run is refused, as a slow load is); before serving it does not:
            # a GPU's first run of each shape takes seconds, and a start-up that always worked stays so
            left = None if every_thread else max(0.0, timeout - (time.perf_counter() - started))
            failed = await self._warmed(model, every_thread, left)
            if failed is not None:
                del model  # the last reference (a warm-up call still on the device thread keeps it until it ends)
        if failed is None:
            return model
        if isinstance(failed, str):  # it ran past the load's time, or its graph failed the warm-up
            await self._release()
            raise ModelLoadError(failed)
        raise await self._device_failed(label, *failed, warming=warming, serving=not every_thread)

    async def load(self, name: str, version: str, every_thread: bool = False) -> ServedModel:
        """Load, check and warm one version, with its own (not yet started) batcher: warmed on
        ``every_thread`` before serving, one batch size a call while serving."""
        started = time.perf_counter()
        model = await self._load_model(name, version, started, every_thread)
        load_s = time.perf_counter() - started
        log.info(
            "model %s/%s ready on %s (%s) in %.2fs",
            name,
            version,
            self.device,
            dtype_name(self.dtype),
            time.perf_counter() - started,
            extra={"model": name, "version": version},
        )
        trace.get_current_span().add_event(
            "model ready", {"model.name": name, "model.version": version, "seconds": _since(started)}
        )
        loop = asyncio.get_running_loop()
        batchers: list[DualWindowBatcher[Job, Answer]] = []

        def on_pressure(size: int) -> None:  # called on the device thread
            loop.call_soon_threadsafe(batchers[0].lower_ceiling, size)

        manifest, folder = model.manifest, model.folder  # not the model: the fallback lets it go

        def cpu_fallback() -> LayeredModel:  # called on the device thread
            fallback = LayeredModel.load(folder, manifest, torch.device("cpu"), torch.float32)
            if self._pads(fallback.device):
                fallback.largest_batch = self._largest_batch
            fallback.load_all_heads()
            fallback.self_check()
            served_from = (str(self.device), dtype_name(self.dtype))
            self.metrics.model_info.labels(name, version, "cpu", "float32").set(1)
            if served_from != ("cpu", "float32"):  # it no longer serves from the device
                with contextlib.suppress(KeyError):
                    self.metrics.model_info.remove(name, version, *served_from)
            return fallback

        faults = self.metrics.device_faults
        runner = ModelRunner(
            model,
            self._device_thread,
            self.settings.server.max_top_k,
            on_pressure=on_pressure,
            on_fault=lambda fault: faults.labels(name, version, fault.value.replace(" ", "_")).inc(),
            fallback=cpu_fallback if self.settings.model.cpu_fallback else None,
            fallback_after=self.settings.model.fallback_after_failures,
            intra_op=self.threads.intra_op,
            fallback_intra_op=self._fallback_intra_op,
        )
        observer = self.metrics.observer(name, version)
        traced = TracedRunner(runner, self.tracer, name, version, dtype_name(self.dtype), observer)
        batcher: DualWindowBatcher[Job, Answer] = DualWindowBatcher(
            traced,
            self._policy(),
            observer=observer,
            name=f"{name}/{version}",
            max_in_flight=self.threads.workers,
            urgent_in_flight=self.threads.urgent,
            computed=lambda answers: sum(reached_the_device(answer) for answer in answers),
            model_epoch=lambda: runner.generation,
            ceiling_ready=lambda size: self.sizes_ready(name, version, size),
        )
        batchers.append(batcher)
        served = ServedModel(name, version, runner, batcher, load_s, observer)
        self.publish(served)
        return served

    def publish(self, served: ServedModel) -> None:
        """``served``'s own series, at their values as it starts: set as its load ends, and set
        again as it joins the routing (a copy of the same version that drained meanwhile removed
        the series it shares with it)."""
        name, version = served.name, served.version
        self.metrics.model_load.labels(name, version).set(served.load_s)
        for counter, labels in served.metrics.series():
            counter.labels(*labels)  # at 0 from the start (see ``Metrics.rejections``)
        self.metrics.model_info.labels(name, version, str(self.device), dtype_name(self.dtype)).set(1)


def _loading(message: str, after_s: float) -> Unavailable:
    """A 503 ``model_loading``: the loader is another load's for about ``after_s`` more."""
    return Unavailable(message, code="model_loading", retry_after_s=max(1, math.ceil(after_s)))


def _what_failed(exc: BaseException) -> str:
    """The line of an error that says what failed: TorchScript's error opens with its own header
    and the graph's code, and ends with the original error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    if len(lines) > 1 and "TorchScript interpreter" in lines[0]:
        return lines[-1]
    return f"{type(exc).__name__}: {lines[0]}"


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)
