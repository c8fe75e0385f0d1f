"""The inference service: models, their batchers, the device thread and the decode pool.

It owns everything with a start and a stop below the HTTP layer. ``start`` loads, checks
and warms every model (``app.versions``); ``admit`` and ``reserve`` say whether a request
can be served in time; ``predict`` takes image bytes through preprocessing, the batcher and
postprocessing (``app.prediction``); ``close`` drains the batchers and stops the threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import random
import time

import torch
from opentelemetry import trace

from app.admission import DecodeBacklog, Seat
from app.batching import BatchPolicy, DualWindowBatcher, Lane
from app.errors import (
    Draining,
    NotFound,
    NotReady,
    quoted,
)
from app.inference import preprocess
from app.inference.device import (
    DeviceThread,
    Memory,
    cpu_cores,
    dtype_name,
    fallback_intra_op,
    memory,
    plan_threads,
    release_memory,
    resolve_device,
    resolve_dtype,
    size_primitive_cache,
)
from app.inference.jobs import Answer, Job
from app.inference.loader import ModelLoadError
from app.inference.repository import ModelEntry, Repository
from app.inference.workers import WorkerThreads
from app.interpreter import Tuning
from app.prediction import Outcome, Predictor
from app.rewarm import Rewarmer
from app.routing import ModelGroup, Routing
from app.served_gauges import ServedGauges
from app.settings import BatchingSettings, Settings
from app.telemetry.metrics import Metrics
from app.versions import ServedModel, VersionLoader, batch_policy

log = logging.getLogger(__name__)

JOIN_S = 10.0  # the close's wait for the threads to finish a call under way (a warm-up, a load)
ABANDONED_JOIN_S = 0.5  # once the drain's grace ran out with work left: a batch nobody awaits


class State(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"
    STOPPED = "stopped"


class InferenceService:
    """Everything between a validated request and its answer."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        tracer: trace.Tracer | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``device``: ``model.device`` resolved already (off the event loop: ``auto`` tries CUDA out)."""
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.tracer = tracer or trace.NoOpTracer()
        self.state = State.STARTING
        self.failure: str | None = None
        self.unfinished: list[str] = []  # its threads a call held past ``close``'s bounded joins
        self.device = device if device is not None else resolve_device(settings.model.device)
        self.dtype = resolve_dtype(settings.model.dtype, self.device)
        self.repository = Repository(settings.model.repository)
        self.groups: dict[str, ModelGroup[ServedModel]] = {}
        self.entries: list[ModelEntry] = []
        self._retiring: set[ServedModel] = set()  # unloaded versions whose requests still finish
        self._drained = False
        self._cut_short = False  # a drain's grace ran out with work left: what still runs is awaited by nobody
        self._halting: asyncio.Task[None] | None = None  # ``halt``'s close of the batchers, with no grace
        self.halted = asyncio.Event()  # set by ``halt``: the close waits for nothing that still runs
        self._rng = random.Random()
        self.default_model: str | None = None
        server = settings.server
        self._limits = preprocess.ImageLimits(
            server.max_image_bytes, server.max_image_pixels, reduce_jpeg=server.jpeg_reduced_decode
        )
        model = settings.model
        cores = model.cores or cpu_cores()
        self.threads = plan_threads(
            self.device,
            model.device_workers,
            model.intra_op_threads,
            settings.server.preprocess_workers,
            cores,
            model.urgent_workers,
            settings.server.decode,
            model.normal_nice,
        )
        self._device_thread = DeviceThread(
            workers=self.threads.workers,
            urgent_workers=self.threads.urgent,
            normal_nice=self.threads.normal_nice,
            urgent_slice_ns=round(model.urgent_slice_ms * 1_000_000),
            urgent_pause_s=model.urgent_pause_ms / 1000,
            # normal batches that may wait for an urgent one at once: the threads beyond the cores,
            # so that every core stays busy while they wait (none where the cores suffice, nor on a
            # GPU, whose batches wait for the device, not for a core)
            pausable=max(0, self.threads.workers + self.threads.urgent - cores) if self.device.type == "cpu" else 0,
        )
        server = settings.server
        self._tuning = Tuning(
            server.switch_interval_ms / 1000,
            server.gc_freeze,
            server.gc_young_threshold,
            server.malloc_retain_mb << 20,
            server.wakeup_preemption,
        )
        self._pool = WorkerThreads("preprocess", self.threads.decode)  # urgent images first
        # admitted requests whose images wait or decode in the pool (decoded in the batch: none, ever)
        self._backlog = DecodeBacklog(self.threads.decode)
        self._predictor = Predictor(
            self.tracer,
            self._pool,
            self._backlog,
            self._limits,
            lambda: self.draining,
            decode_in_batch=self.threads.decode_in_batch,
        )
        self._policy = batch_policy(settings.batching)
        self.loader = VersionLoader(
            settings,
            self.repository,
            self.device,
            self.dtype,
            self.threads,
            self._device_thread,
            self.metrics,
            self.tracer,
            policy=lambda: self._policy,
            release=self.release_unloaded,
            fallback_intra_op=fallback_intra_op(self.threads, model.intra_op_threads, cores),
        )
        self.rewarm = Rewarmer(self.loader, self.all_served)  # the sizes a new max batch brings, warmed while serving
        self.loader.sizes_ready = self._sizes_ready  # and those a batch ceiling's rise lets in
        ServedGauges(self.all_served, self._retiring, self.device).install(self.metrics)

    @property
    def models(self) -> dict[str, ServedModel]:
        """Each model's default version."""
        return {name: group.default for name, group in self.groups.items()}

    def all_served(self) -> list[ServedModel]:
        """Every loaded version of every model."""
        return [served for group in self.groups.values() for served in group.routing.loaded.values()]

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
            # a change made while it loaded (the watcher and the admin API run meanwhile) was not
            # warmed by ``set_policy``, which warms only once ready: the versions loaded before it lack its sizes
            self.rewarm.start()
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
        loaded = {version: await self.loader.load(entry.name, version, every_thread=True) for version in versions}
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
        return await self.loader.load(name, version)

    @property
    def late_loads(self) -> list[str]:
        """``name/version`` of the loads past their timeout that still run on the loader thread."""
        return self.loader.late_loads

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
            # loaded again while this copy drained: the labels are the new copy's, which removes
            # them, this copy's batch-size buckets among them, when it goes
            group.routing.loaded[served.version].metrics.adopt(served.metrics)
            return
        for gauge, labels in (
            (self.metrics.model_info, (served.name, served.version, str(self.device), dtype_name(self.dtype))),
            (self.metrics.model_info, (served.name, served.version, "cpu", "float32")),  # after a CPU fallback
            (self.metrics.model_load, (served.name, served.version)),
            *served.metrics.series(),
        ):
            with contextlib.suppress(KeyError):  # never set (a fallback that did not happen)
                gauge.remove(*labels)

    async def release_unloaded(self) -> None:
        """Free what unloaded versions held: the collector (frozen once warm) must look at them
        again, and on CUDA the freed blocks go back to the driver (off the loop: it waits for the
        device, which may be running a batch). A background warm-up's device call ends first: it
        may hold the version just unloaded, whose blocks would be freed after the release."""
        await self.rewarm.settled()
        await asyncio.to_thread(self._tuning.collect_unloaded)
        await asyncio.to_thread(release_memory, self.device)

    @property
    def policy(self) -> BatchPolicy:
        """The batching policy in force (a batcher made meanwhile takes it as it starts)."""
        return self._policy

    def set_policy(self, batching: BatchingSettings) -> None:
        """Every batcher takes the new policy from its next batch; batch sizes it newly allows are
        warmed in the background (on the event loop: it starts that task)."""
        before, self._policy = self._policy, batch_policy(batching)
        for served in self.all_served():
            served.batcher.set_policy(self._policy)
        # lowered, a padded batch may take a new size too (the new largest, no power of two)
        if self.state is State.READY and self._policy.largest_batch != before.largest_batch:
            self.rewarm.start()

    def _sizes_ready(self, name: str, version: str, size: int) -> bool:
        """Whether ``name/version``'s batch ceiling may rise to ``size`` (see ``Rewarmer.ready``):
        not while draining, which starts no warm-up (the ceiling only holds a while longer)."""
        return self.state is State.READY and self.rewarm.ready(name, version, size)

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
        served.batcher.intake.admit(lane, timeout_s, upstream_s=self._backlog.wait_s(lane))

    def reserve(self, served: ServedModel, lane: Lane, timeout_s: float, admitted: bool = False) -> Seat:
        """``admit``, and hold the request's ``Seat`` in its lane until it is queued: meanwhile
        (its image decoded) it counts as queued ahead of later requests. ``admitted``: ``admit``
        let it in before its body came, and a close since lets it on while the batcher runs."""
        intake = served.batcher.intake
        intake.admit(lane, timeout_s, reserve=True, upstream_s=self._backlog.wait_s(lane), admitted=admitted)
        return self._backlog.seat(intake, lane)

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
        reserved once the body was whole (else it is reserved here); from the queue on, the
        deadline alone can end the request, never a second prediction.
        Each stage is a span under the caller's (the HTTP request's) span. ``served`` is the
        version routing chose; the request stays on it whatever is promoted meanwhile.
        """
        deadline = time.monotonic() + timeout_s
        # a seat in its lane, held while the image decodes: a backlog upstream of the queue
        # counts as queued, so overload is refused at admission, not after a long wait
        seat = seat or self.reserve(served, lane, timeout_s)
        if lane is not Lane.URGENT:
            return await self._predictor.predict(served, image, top_k, lane, deadline, request_id, seat)
        self._tuning.urgent_began()  # the loop pre-empts while it is in flight (app.interpreter)
        try:
            return await self._predictor.predict(served, image, top_k, lane, deadline, request_id, seat)
        finally:
            self._tuning.urgent_ended()

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
        """Stop now, with no grace (Ctrl-C, or a second SIGTERM or SIGQUIT during a drain): readiness
        and predictions turn 503 at once, and every batcher closes at once, a drain under way
        included: what is queued or running is answered 503 ``draining`` now, and a batch still
        running on a device thread is abandoned as one past the grace is (``close`` does not wait
        for it past ``ABANDONED_JOIN_S``). Called on the event loop."""
        if self.state in (State.READY, State.STARTING):
            self.state = State.DRAINING
        self.halted.set()
        if self._halting is None and self.state is not State.STOPPED:
            self._halting = asyncio.get_running_loop().create_task(self._close_batchers(0), name="halt")

    def _batchers(self) -> list[DualWindowBatcher[Job, Answer]]:
        return [served.batcher for served in (*self.all_served(), *self._retiring)]

    async def _close_batchers(self, grace_s: float | None) -> None:
        await asyncio.gather(*(batcher.close(grace_s) for batcher in self._batchers()))

    async def drain(self, grace_s: float | None) -> None:
        """Stop taking work (readiness and predictions turn 503 at once) and let queued and
        running requests finish within ``grace_s``; whatever is left then gets 503. A ``halt``
        ends it at once, whatever ``grace_s``."""
        if self.state in (State.READY, State.STARTING):  # a start still loading never turns ready
            self.state = State.DRAINING
        started = time.perf_counter()
        batchers = self._batchers()
        # halted: no grace left; a halt meanwhile closes them at once, which ends these closes too
        await self._close_batchers(0 if self._halting is not None else grace_s)
        if self._halting is not None:  # shielded: a drain cancelled here leaves the halt's close to answer what it took
            await asyncio.shield(self._halting)
        cut = sum(batcher.cut_off for batcher in batchers)
        self._cut_short = self._cut_short or cut > 0
        if cut and not self._drained and self._halting is not None:
            log.warning(
                "the service stopped at once (a second signal, Ctrl-C): %d queued or running request(s) "
                "answered 503 draining",
                cut,
            )
        elif cut and not self._drained and grace_s is None:  # no grace to run out: a drain stopped (cancelled)
            log.warning(
                "the drain (no time limit) was stopped before it ended: %d queued or running request(s) "
                "answered 503 draining",
                cut,
            )
        elif cut and not self._drained:  # an operator's cue to give the drain more time
            log.warning(
                "the drain's grace (%s) ran out: %d queued or running request(s) answered 503 draining",
                "none: stopping at once" if grace_s == 0 else f"{grace_s:g} s",
                cut,
            )
        elif not self._drained:  # the close drains again after a SIGTERM's drain: nothing is left then
            log.info("drained in %.2fs", time.perf_counter() - started)
        self._drained = True

    async def close(self, grace_s: float | None) -> None:
        """Drain (if nobody did yet), then stop the threads and release the device. The process's
        tuning is put back however it ends (cut short, the loop's thread would stay batch)."""
        try:
            await self.rewarm.close()
            await self.drain(grace_s)
            # joined, bounded: threads left inside torch at interpreter exit can abort the process
            # (the CLI then exits without finalizing it). Once the grace ran out, a batch still
            # running is awaited by nobody (each of its requests has its 503): the exit does not
            # wait for it past the grace, which an orchestrator's kill would end first; nor, once
            # halted (a second signal, Ctrl-C), for what still runs
            abandoning = self._cut_short or self._halting is not None
            join_s = ABANDONED_JOIN_S if abandoning else JOIN_S
            decode = await asyncio.to_thread(self._pool.close, join_s, cancel_waiting=True)
            device, loader = await asyncio.gather(
                asyncio.to_thread(self._device_thread.close, join_s),
                # an admin load still running once halted is abandoned too (the lifespan stopped waiting for it)
                asyncio.to_thread(self.loader.close, ABANDONED_JOIN_S if self._halting is not None else JOIN_S),
            )
            if device and abandoning:
                log.warning(
                    "shutdown: a batch still running on %s %s was abandoned, not awaited "
                    "(its requests had their 503 already)",
                    ", ".join(device),
                    "past the grace" if self._halting is None else "when the service stopped at once",
                )
            self.unfinished = [*decode, *device, *loader]
            if self.device.type == "cuda":
                self.groups.clear()  # the models sit in reference cycles: collected, then released
                await self.release_unloaded()
        finally:
            self._tuning.restore()
        self.state = State.STOPPED
