"""The inference service: models, their batchers, the device thread and the decode pool.

It owns everything with a start and a stop below the HTTP layer. ``start`` loads, checks
and warms every model; ``predict`` takes image bytes through preprocessing, the batcher
and postprocessing; ``close`` drains the batchers and stops the threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import cast

import torch
from opentelemetry import trace
from opentelemetry.trace import Link, Span, Status, StatusCode

from app.admission import DecodeBacklog, Seat
from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy
from app.deadline import within
from app.errors import (
    DeadlineExceeded,
    DeviceUnavailable,
    Draining,
    NotFound,
    NotReady,
    ServiceError,
    Unavailable,
    quoted,
)
from app.inference import preprocess
from app.inference.bounded import BoundedCall
from app.inference.device import (
    DeviceThread,
    Fault,
    Memory,
    cpu_cores,
    device_fault,
    dtype_name,
    fault_line,
    memory,
    plan_threads,
    release_memory,
    resolve_device,
    resolve_dtype,
    size_primitive_cache,
)
from app.inference.jobs import Answer, BatchTrace, Job, TracedRunner, batch_trace_of
from app.inference.loader import LayeredModel, ModelLoadError
from app.inference.manifest import InputSpec
from app.inference.postprocess import Prediction, label
from app.inference.repository import ModelEntry, Repository
from app.inference.runner import ModelRunner
from app.inference.workers import WorkerThreads
from app.interpreter import Tuning
from app.routing import ModelGroup, Routing, VersionNotLoaded
from app.settings import BatchingSettings, LaneSettings, Settings
from app.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class State(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"
    STOPPED = "stopped"


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

    @property
    def model(self) -> LayeredModel:
        """The model that serves now: the runner's, which its CPU fallback replaces (no other
        reference may keep a failed device's model, and its memory, alive)."""
        return cast(LayeredModel, self.runner.model)

    @property
    def labels(self) -> tuple[str, ...]:
        return self.model.manifest.labels


@dataclass(frozen=True)
class Outcome:
    """One answered prediction and the timings of its stages, in seconds."""

    model: str
    version: str
    predictions: list[Prediction]
    lane: Lane
    batch_size: int
    preprocess_s: float
    queue_s: float
    inference_s: float


def _decode_before(
    deadline: float, payload: bytes | str, spec: InputSpec, limits: preprocess.ImageLimits
) -> tuple[torch.Tensor, float]:
    """In the decode pool: the tensor and the seconds decoding took. An image whose request's
    deadline passed while it waited is not decoded."""
    started = time.monotonic()
    if started >= deadline:
        raise DeadlineExceeded("the request's deadline passed while its image waited to be decoded")
    return preprocess.decode_payload(payload, spec, limits), time.monotonic() - started


class InferenceService:
    """Everything between a validated request and its answer."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None, tracer: trace.Tracer | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.tracer = tracer or trace.NoOpTracer()
        self.state = State.STARTING
        self.failure: str | None = None
        self.device = resolve_device(settings.model.device)
        self.dtype = resolve_dtype(settings.model.dtype, self.device)
        self.repository = Repository(settings.model.repository)
        self.groups: dict[str, ModelGroup[ServedModel]] = {}
        self.entries: list[ModelEntry] = []
        self._retiring: set[ServedModel] = set()  # unloaded versions whose requests still finish
        self._late_loads: set[str] = set()  # loads past their timeout, still running on the loader thread
        self._rng = random.Random()
        self.default_model: str | None = None
        self._limits = preprocess.ImageLimits(settings.server.max_image_bytes, settings.server.max_image_pixels)
        model = settings.model
        self.threads = plan_threads(
            self.device,
            model.device_workers,
            model.intra_op_threads,
            settings.server.preprocess_workers,
            cpu_cores(),
            model.urgent_workers,
        )
        self._device_thread = DeviceThread(
            workers=self.threads.workers, urgent_workers=self.threads.urgent, normal_nice=model.normal_nice
        )
        # loads read, checksum, build and self-check a version on a thread of their own: on the
        # device's (a GPU has one) a version loaded while serving held every batch for seconds.
        # Where normal batches run niced (a CPU with an urgent thread), a load is as low: it must
        # not take an urgent batch's core either
        self._loader = WorkerThreads("loader", nice=model.normal_nice if self.threads.urgent else 0)
        server = settings.server
        self._tuning = Tuning(
            server.switch_interval_ms / 1000, server.gc_freeze, server.gc_young_threshold, server.malloc_retain_mb << 20
        )
        self._pool = WorkerThreads("preprocess", self.threads.decode)  # urgent images first
        self._backlog = DecodeBacklog(self.threads.decode)  # admitted requests whose images wait or decode
        self._policy = batch_policy(settings.batching)
        self.metrics.scrape_time.queue_depths = self._queue_depths
        self.metrics.scrape_time.queue_capacities = self._queue_capacities
        if self.device.type == "cuda":
            self.metrics.scrape_time.device_memory = self._cuda_memory
            self.metrics.scrape_time.device_memory_total = self._cuda_memory_total

    @property
    def models(self) -> dict[str, ServedModel]:
        """Each model's default version."""
        return {name: group.default for name, group in self.groups.items()}

    def all_served(self) -> list[ServedModel]:
        """Every loaded version of every model."""
        return [served for group in self.groups.values() for served in group.routing.loaded.values()]

    def _queue_depths(self) -> list[tuple[str, str, str, int]]:
        """Each version's queues, an unloaded one's too while they drain (its requests still wait
        there); a version loaded again meanwhile has both copies' requests in one series."""
        depths: dict[tuple[str, str, str], int] = {}
        for served in (*self.all_served(), *self._retiring):
            for lane in Lane:
                key = (served.name, served.version, lane.value)
                depths[key] = depths.get(key, 0) + served.batcher.depth(lane)
        return [(*key, depth) for key, depth in depths.items()]

    def _queue_capacities(self) -> list[tuple[str, str, str, int]]:
        """Each version's queue bounds, an unloaded one's while it drains (a loaded copy's first)."""
        capacities: dict[tuple[str, str, str], int] = {}
        for served in (*self.all_served(), *self._retiring):
            for lane in Lane:
                capacities.setdefault(
                    (served.name, served.version, lane.value), served.batcher.policy.lane(lane).max_queue
                )
        return [(*key, capacity) for key, capacity in capacities.items()]

    def _cuda_memory_total(self) -> list[int]:
        return [torch.cuda.get_device_properties(self.device).total_memory]

    def _cuda_memory(self) -> list[tuple[str, int]]:
        return [
            ("allocated", torch.cuda.memory_allocated(self.device)),
            ("reserved", torch.cuda.memory_reserved(self.device)),
        ]

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def draining(self) -> bool:
        return self.state in (State.DRAINING, State.STOPPED)

    @property
    def degraded(self) -> bool:
        """Some model is served by its CPU fallback after its device kept failing."""
        return any(served.runner.degraded for served in self.all_served())

    async def start(self) -> None:
        """Load, self-check and warm every configured model, then start their batchers.

        Raises ``ModelLoadError`` (or ``TimeoutError``) with a message naming the problem.
        """
        try:
            await self._device_thread.run(self._configure_threads)
            self._tuning.apply()
            entries = self.entries = await asyncio.to_thread(self.repository.models)
            wanted = self.settings.model.names or [entry.name for entry in entries]
            found = {entry.name: entry for entry in entries}
            missing = [name for name in wanted if name not in found]
            if not wanted:
                raise ModelLoadError(
                    f"model repository {self.repository.described()} has no model in it: a model is a folder "
                    "<name>/<version>/manifest.json with its files (ai-backend export or train-digits writes one)"
                )
            if missing:
                raise ModelLoadError(f"model repository {self.repository.described()} has no model named {missing}")
            default = self.settings.model.default or wanted[0]
            if default not in wanted:
                raise ModelLoadError(f"model.default={default} is not among the models served: {wanted}")
            for name in wanted:
                self.groups[name] = await self._load_group(found[name])
            self.default_model = default
            await self._warm_pool()
            self._tuning.freeze()
            if self.state is not State.STARTING:  # a SIGTERM came while it loaded: nothing is served
                return
            for served in self.all_served():
                served.batcher.set_policy(self._policy)  # a change made while later versions loaded
                served.batcher.start()
            self.state = State.READY
        except BaseException as exc:
            self.state = State.FAILED
            self.failure = str(exc)
            raise

    def _versions_to_load(self, entry: ModelEntry) -> list[str]:
        listed = self.settings.model.versions.get(entry.name)
        if listed:
            missing = [v for v in listed if v not in entry.versions]
            if missing:
                raise ModelLoadError(f"model.versions lists {entry.name} versions {missing} not in the repository")
            return sorted(listed, key=int)
        policy = self.settings.model.load_versions
        if policy == "all":
            return list(entry.versions)
        count = int(policy.partition(":")[2] or 1)
        return list(entry.versions[-count:])

    async def _load_group(self, entry: ModelEntry) -> ModelGroup[ServedModel]:
        versions = self._versions_to_load(entry)
        loaded = {version: await self._load(entry.name, version, every_thread=True) for version in versions}
        default = self.settings.model.default_versions.get(entry.name, versions[-1])
        try:
            routing = Routing(loaded, default, canary=self.settings.model.canary.get(entry.name, {}))
        except ValueError as exc:
            raise ModelLoadError(f"model {entry.name}: {exc} (loaded versions: {versions})") from exc
        return ModelGroup(entry.name, entry.versions, routing, self._rng)

    async def _warm_pool(self) -> None:
        """Decode one image per worker, so the first requests pay no thread or codec start-up."""
        spec = self.all_served()[0].model.manifest.input
        sample = preprocess.blank_png(spec.width, spec.height)
        decode = functools.partial(preprocess.decode, sample, spec, self._limits)
        await asyncio.gather(*(self._pool.run(decode) for _ in range(self._pool.workers)))

    def _configure_threads(self) -> None:
        size_primitive_cache(self.settings.model.onednn_primitive_cache)  # before any model runs
        if self.threads.intra_op:
            torch.set_num_threads(self.threads.intra_op)
        if self.settings.model.inter_op_threads:
            try:
                torch.set_num_interop_threads(self.settings.model.inter_op_threads)
            except RuntimeError:  # only settable once per process
                log.warning("inter-op threads already set; keeping %d", torch.get_num_interop_threads())

    async def load_version(self, name: str, version: str) -> ServedModel:
        """Load, check and warm one version, with its own (not yet started) batcher."""
        return await self._load(name, version)

    async def retire(self, served: ServedModel) -> None:
        """An unloaded version (out of routing already): its queued and running requests, and
        those routed to it still on their way, finish within the grace period (a shutdown waits
        for them too); then its metrics go. Its memory goes at ``release_unloaded``, once the
        caller holds no reference to it."""
        self._retiring.add(served)
        try:
            await served.batcher.close(self.settings.server.shutdown_grace_s)
        finally:
            self._retiring.discard(served)
        group = self.groups.get(served.name)
        if group is not None and served.version in group.routing.loaded:
            return  # loaded again while this copy drained: the labels are the new copy's
        for gauge, labels in (
            (self.metrics.model_info, (served.name, served.version, str(self.device), dtype_name(self.dtype))),
            (self.metrics.model_info, (served.name, served.version, "cpu", "float32")),  # after a CPU fallback
            (self.metrics.model_load, (served.name, served.version)),
        ):
            with contextlib.suppress(KeyError):  # never set (a fallback that did not happen)
                gauge.remove(*labels)

    async def release_unloaded(self) -> None:
        """Free what unloaded versions held: the collector (frozen once warm) must look at them
        again, and on CUDA the freed blocks go back to the driver (off the loop: it waits for the
        device, which may be running a batch)."""
        await asyncio.to_thread(self._tuning.collect_unloaded)
        await asyncio.to_thread(release_memory, self.device)

    @property
    def late_loads(self) -> list[str]:
        """``name/version`` of the loads past their timeout that still run on the loader thread."""
        return sorted(self._late_loads)

    def _late_load_ended(self, label: str, started: float, timeout: float) -> None:
        """On the loop, once a late load ends (``started``: its ``perf_counter`` at the start)."""
        self._late_loads.discard(label)
        log.warning(
            "the load of %s given up after model.load_timeout_s=%gs (or cancelled) ended %.1fs after it began; "
            "what it loaded was dropped",
            label,
            timeout,
            time.perf_counter() - started,
        )

    async def _device_failed(self, label: str, fault: Fault, line: str) -> DeviceUnavailable:
        """A load the device failed (out of memory beside the versions already loaded, say): the
        memory it took released, a 503 ``device_unavailable`` (any other error is a bug: 500).
        Called once the error is handled and gone: its traceback held the model's frames, and
        with them the memory to release."""
        await self.release_unloaded()  # the model sits in reference cycles: collected, then released
        log.error("loading %s: the device failed (%s): %s", label, fault.value, line)
        return DeviceUnavailable(f"loading {label}: the device failed ({fault.value}); try again later")

    async def _warm_up(self, model: LayeredModel, every_thread: bool) -> None:
        """Run the batch sizes serving will see. Before serving, on every device thread: each
        keeps its own allocator arena, grown to the largest batch it has run, and warmed on one
        the others grew under the first heavy load instead (mobilenet_v3_small at batch 32: 750
        MiB resident once ready, 960 once the other two threads had run a batch of 32). A version
        loaded while serving warms one batch size a call (the arenas are grown by then), so the
        batches queued meanwhile run between them, urgent ones first: a GPU has one thread."""
        biggest = max(self._policy.urgent.max_batch, self._policy.normal.max_batch)
        if every_thread:
            await self._device_thread.run_on_each(functools.partial(model.warm_up, biggest))
            return
        for size in model.warm_up_sizes(biggest):
            await self._device_thread.run(functools.partial(model.warm_up, biggest, sizes=(size,)))

    async def _warmed(self, model: LayeredModel, every_thread: bool) -> tuple[Fault, str] | None:
        """Warm ``model`` up; the device's failure (its fault and line) if the device failed it."""
        try:
            await self._warm_up(model, every_thread)
        except Exception as exc:
            if (fault := device_fault(exc)) is None:
                raise
            return fault, fault_line(exc)
        return None

    async def _load_model(self, name: str, version: str, started: float, every_thread: bool) -> LayeredModel:
        """Load, check and warm one version's model, within ``model.load_timeout_s``."""
        folder = self.repository.folder(name, version)
        timeout = self.settings.model.load_timeout_s
        if self._late_loads:
            raise Unavailable(
                f"loading {', '.join(self.late_loads)} passed model.load_timeout_s and still runs on "
                "the loader thread; another load can start once it ends",
                code="model_loading",
                retry_after_s=max(1, math.ceil(timeout)),
            )

        def load() -> LayeredModel:
            manifest = self.repository.manifest(name, version)
            model = LayeredModel.load(folder, manifest, self.device, self.dtype)
            if self.settings.model.eager_heads:
                model.load_all_heads()
            elif self.settings.model.warmup:  # the warm-up's first use: here, not on a device thread
                model.head()
            model.self_check()
            return model

        label = f"{name}/{version}"
        bounded = BoundedCall(
            load,
            release=functools.partial(release_memory, self.device),
            on_late_end=functools.partial(self._late_load_ended, label, started, timeout),
        )
        failed: tuple[Fault, str] | None = None  # the device failed it: released once the error is gone
        refused: str | None = None  # its files or graph refused it: on a GPU, what it moved there is released
        try:
            model = await bounded.run(self._loader, timeout)
        except TimeoutError as exc:
            raise ModelLoadError(
                f"loading {folder} took longer than model.load_timeout_s={timeout:g}s "
                "(AI_SERVICE_MODEL__LOAD_TIMEOUT_S)"
            ) from exc
        except (ModelLoadError, ValueError) as exc:  # a bad file, graph or manifest
            refused = str(exc)
        except Exception as exc:
            if (fault := device_fault(exc)) is None:
                raise
            failed = fault, fault_line(exc)
        finally:
            if bounded.late:  # timed out or cancelled: a thread cannot be stopped, it ends when it ends
                self._late_loads.add(label)
        if refused is not None:
            await self.release_unloaded()  # the error, whose frames held what it built, is gone by now
            raise ModelLoadError(refused)
        if failed is None and self.settings.model.warmup:
            failed = await self._warmed(model, every_thread)
            if failed is not None:
                del model  # the last reference, now the error's frames are gone: before the release
        if failed is not None:
            raise await self._device_failed(label, *failed)
        return model

    async def _load(self, name: str, version: str, every_thread: bool = False) -> ServedModel:
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
        loop = asyncio.get_running_loop()
        batchers: list[DualWindowBatcher[Job, Answer]] = []

        def on_pressure(size: int) -> None:  # called on the device thread
            loop.call_soon_threadsafe(batchers[0].lower_ceiling, size)

        manifest, folder = model.manifest, model.folder  # not the model: the fallback lets it go

        def cpu_fallback() -> LayeredModel:  # called on the device thread
            fallback = LayeredModel.load(folder, manifest, torch.device("cpu"), torch.float32)
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
        )
        observer = self.metrics.observer(name, version)
        traced = TracedRunner(runner, self.tracer, name, version, dtype_name(self.dtype), observer)
        batcher: DualWindowBatcher[Job, Answer] = DualWindowBatcher(
            traced,
            self._policy,
            observer=observer,
            name=f"{name}/{version}",
            max_in_flight=self.threads.workers,
            urgent_in_flight=self.threads.urgent,
            computed=lambda answers: sum(answer.top is not None for answer in answers),
            model_epoch=lambda: runner.generation,
        )
        batchers.append(batcher)
        self.metrics.model_load.labels(name, version).set(time.perf_counter() - started)
        self.metrics.model_info.labels(name, version, str(self.device), dtype_name(self.dtype)).set(1)
        return ServedModel(name, version, runner, batcher, load_s)

    def set_policy(self, batching: BatchingSettings) -> None:
        """Every batcher takes the new policy from its next batch."""
        self._policy = batch_policy(batching)
        for served in self.all_served():
            served.batcher.set_policy(self._policy)

    def served(self, name: str | None, version: str | None = None) -> ServedModel:
        """The version that answers: pinned, canary, or default; 404 unknown, 503 not ready/loaded."""
        if self.state in (State.DRAINING, State.STOPPED):
            raise Draining("the service is shutting down")
        if not self.ready:
            raise NotReady(f"the service is {self.state.value}")
        key = name or self.default_model
        group = self.groups.get(key) if key else None
        if group is None:
            raise NotFound(f"no model named {quoted(name) if name is not None else None}", code="model_not_found")
        return group.route(version)

    def admit(self, served: ServedModel, lane: Lane, timeout_s: float) -> None:
        """Refuse at once (503) what cannot be answered in time: the batcher's own rules, with the
        wait for a decode thread in front of it. Cheap: the edge asks it before routing."""
        served.batcher.admit(lane, timeout_s, upstream_s=self._backlog.wait_s(lane))

    def reserve(self, served: ServedModel, lane: Lane, timeout_s: float, admitted: bool = False) -> Seat:
        """``admit``, and hold the request's ``Seat`` in its lane until it is queued: meanwhile
        (its image decoded) it counts as queued ahead of later requests. ``admitted``: ``admit``
        let it in before its body came, and a close since lets it on while the batcher runs."""
        served.batcher.admit(lane, timeout_s, reserve=True, upstream_s=self._backlog.wait_s(lane), admitted=admitted)
        return self._backlog.seat(served.batcher, lane)

    async def predict(
        self,
        served: ServedModel,
        image: bytes | str,
        top_k: int,
        lane: Lane,
        timeout_s: float,
        request_id: str = "",
        seat: Seat | None = None,
    ) -> Outcome:
        """Decode ``image`` (bytes, or base64 text from a JSON body), batch it, run it, and
        label the top ``top_k`` classes.

        ``timeout_s`` is what is left of the request's deadline. ``seat`` is the one the route
        reserved before reading the body (else it is reserved here); from the queue on, the
        deadline alone can end the request, never a second prediction.
        Each stage is a span under the caller's (the HTTP request's) span. ``served`` is the
        version routing chose; the request stays on it whatever is promoted meanwhile.
        """
        deadline = time.monotonic() + timeout_s
        # a seat in its lane, held while the image decodes (the route takes it before reading
        # the body): a backlog upstream of the queue counts as queued, so overload is refused
        # at admission, not after a long wait
        seat = seat or self.reserve(served, lane, timeout_s)
        ids = {"request.id": request_id, "model.name": served.name, "model.version": served.version}
        started = time.perf_counter()
        tensor = await self._decode(served, image, lane, deadline, ids, seat)
        preprocessed = time.perf_counter()
        job = Job(tensor, lane, request_id, trace.get_current_span().get_span_context(), deadline)
        queue_span = self.tracer.start_span("queue", attributes={**ids, "lane": lane.value})
        try:
            done = await served.batcher.submit(job, lane, deadline - time.monotonic(), admitted=True)
        except BaseException as exc:
            raise self._queue_failed(served, job, queue_span, ids, exc) from exc.__cause__
        # the batch's own times, not this coroutine's: requests later in a batch resume later
        dispatched_ns, ended_ns = done.output.started_ns, done.output.ended_ns
        queue_span.end(end_time=dispatched_ns)
        top = done.output.top
        ran = BatchTrace(done.output.batch_span, dispatched_ns, done.batch_size, done.batch_lane)
        if top is None or isinstance(top, ServiceError):  # None: left out at the device (counted there)
            error = (
                DeadlineExceeded("the request's deadline passed while its batch waited for the device")
                if top is None
                else top
            )
            self._inference_span(ids, ran, error).end(end_time=ended_ns)
            raise error
        self._inference_span(ids, ran, None).end(end_time=ended_ns)
        with self.tracer.start_as_current_span("postprocess", attributes=ids):
            predictions = label(top, served.labels, top_k)
        return Outcome(
            served.name,
            served.version,
            predictions,
            lane,
            done.batch_size,
            preprocessed - started,
            done.queued_s,
            done.run_s,
        )

    async def _decode(
        self, served: ServedModel, image: bytes | str, lane: Lane, deadline: float, ids: dict[str, str], seat: Seat
    ) -> torch.Tensor:
        """The request's image, decoded on the pool by its deadline; its seat released either way."""
        try:
            # the exception recorded, the span failed only for a failure of the service's (a 5xx):
            # a bad upload or a client that went is the client's, and Jaeger's error search would list them
            with self.tracer.start_as_current_span(
                "preprocess", attributes=ids, record_exception=False, set_status_on_exception=False
            ) as span:
                spec = served.model.manifest.input
                decode = functools.partial(_decode_before, deadline, image, spec, self._limits)
                # answered at its deadline, not when a decode thread is free (a decode that
                # has not started is called off; one that has is not, and its image is dropped)
                expired = functools.partial(served.batcher.observer.on_dropped, lane, "deadline")
                try:
                    async with within(deadline, "while its image waited to be decoded", expired):
                        tensor, decode_s = await self._pool.run(decode, urgent=lane is Lane.URGENT)
                except BaseException as exc:
                    _fail(span, exc)
                    raise
            self._backlog.record(decode_s)
        except asyncio.CancelledError:  # its client went (or the close called the decode off)
            served.batcher.observer.on_dropped(lane, "cancelled")
            raise
        finally:
            seat.release()
        return tensor

    def _queue_failed(
        self, served: ServedModel, job: Job, queue_span: Span, ids: dict[str, str], exc: BaseException
    ) -> BaseException:
        """What to raise for a request that left the queue with ``exc``, its spans ended: the
        queue's at its batch's start if one ran it, and then its ``inference`` span, linked."""
        failed = None if isinstance(exc, asyncio.CancelledError) else batch_trace_of(exc)
        if failed is not None:  # its whole batch failed: the queue did its part, inference did not
            queue_span.end(end_time=failed.started_ns)
            if job.left_out:  # not computed: its deadline passed at the device (or its client went)
                exc = DeadlineExceeded("the request's deadline passed while its batch waited for the device")
            self._inference_span(ids, failed, exc).end()
            return exc
        if isinstance(exc, asyncio.CancelledError):
            job.gone = True  # its client went: if its batch formed already, the device leaves it out
        if (running := job.batch) is not None:  # it ended while its batch ran: the queue's part ended then
            queue_span.end(end_time=running.started_ns)
            inference = self._inference_span(ids, running, None)
            _fail(inference, exc)
            inference.end()
        else:
            _fail(queue_span, exc)
            queue_span.end()
        if isinstance(exc, Draining) and not self.draining:  # its version closed, not the service
            return VersionNotLoaded(f"version {served.version} of {served.name} was unloaded before this request ran")
        return exc

    def _inference_span(self, ids: dict[str, str], batch: BatchTrace, error: BaseException | None) -> Span:
        """A request's ``inference`` span: from its batch's start, linked to the batch's span
        (the batch has a trace of its own), failed with ``error`` when it did not get an answer."""
        span = self.tracer.start_span(
            "inference",
            start_time=batch.started_ns,
            links=[Link(batch.span)] if batch.span.is_valid else None,
            attributes={
                **ids,
                "batch.size": batch.size,
                "batch.lane": batch.lane.value,
                "batch.trace_id": format(batch.span.trace_id, "032x"),  # Jaeger: search the batch's trace
            },
        )
        if error is not None:
            code = error.code if isinstance(error, ServiceError) else type(error).__name__
            span.set_status(Status(StatusCode.ERROR, f"{code}: {error}"))
        return span

    async def memory(self) -> Memory:
        """Of the device the models run on: the host's once every one fell back to the CPU. A
        device that cannot say (its context lost) has none free."""
        served = self.all_served()
        device = torch.device("cpu") if served and all(s.runner.degraded for s in served) else self.device
        try:
            return await asyncio.to_thread(memory, device)
        except RuntimeError as exc:
            log.warning("could not read %s memory: %s", device, str(exc).splitlines()[0])
            return Memory(0, 0)

    def halt(self) -> None:
        """Stop taking work now, with no grace (Ctrl-C): readiness and predictions turn 503 at
        once, and what the server then cuts off is answered 503 ``draining``."""
        if self.state in (State.READY, State.STARTING):
            self.state = State.DRAINING

    async def drain(self, grace_s: float | None) -> None:
        """Stop taking work (readiness and predictions turn 503 at once) and let queued and
        running requests finish within ``grace_s``; whatever is left then gets 503."""
        if self.state in (State.READY, State.STARTING):  # a start still loading never turns ready
            self.state = State.DRAINING
        started = time.perf_counter()
        batchers = [served.batcher for served in (*self.all_served(), *self._retiring)]
        await asyncio.gather(*(batcher.close(grace_s) for batcher in batchers))
        log.info("drained in %.2fs", time.perf_counter() - started)

    async def close(self, grace_s: float | None) -> None:
        """Drain (if nobody did yet), then stop the threads and release the device."""
        await self.drain(grace_s)
        # joined, bounded: threads left inside torch at interpreter exit can abort the process
        await asyncio.to_thread(self._pool.close, cancel_waiting=True)
        await asyncio.gather(asyncio.to_thread(self._device_thread.close), asyncio.to_thread(self._loader.close))
        if self.device.type == "cuda":
            self.groups.clear()  # the models sit in reference cycles: collected, then released
            await self.release_unloaded()
        self._tuning.restore()
        self.state = State.STOPPED


def _fail(span: Span, exc: BaseException) -> None:
    """Record why a request's stage ended; fail the span only for what fails the service (a 5xx),
    not the client's mistakes (4xx) or its going away."""
    if isinstance(exc, asyncio.CancelledError):
        span.add_event("client went")
        return
    span.record_exception(exc)
    if not isinstance(exc, ServiceError) or exc.status >= 500:
        code = exc.code if isinstance(exc, ServiceError) else type(exc).__name__
        span.set_status(Status(StatusCode.ERROR, f"{code}: {exc}"))
