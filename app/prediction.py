"""A prediction's way through the service once admitted: its image decoded on the pool (or
checked and left for its batch's device thread to decode), queued in its lane, run in a batch
on a device thread, labelled; a span for each stage, correlated
by the request's id, and the request's end at its deadline or its client's going at each."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from opentelemetry import trace
from opentelemetry.trace import Link, Span, Status, StatusCode

from app.admission import DecodeBacklog, Seat
from app.batching import Lane
from app.deadline import within
from app.errors import DeadlineExceeded, Draining, ServiceError, fails_the_service
from app.inference import preprocess
from app.inference.jobs import BatchTrace, Job, batch_trace_of
from app.inference.manifest import InputSpec
from app.inference.postprocess import Prediction, label
from app.inference.workers import WorkerThreads
from app.routing import VersionNotLoaded
from app.versions import ServedModel


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


class Predictor:
    """Runs admitted predictions: ``pool`` decodes their images (``backlog`` learns how long a
    decode takes), or with ``decode_in_batch`` the device thread that runs an image's batch
    decodes it, just before the forward pass (``server.decode``); ``draining`` says whether the
    service is shutting down (a version closed under a request otherwise was unloaded)."""

    def __init__(
        self,
        tracer: trace.Tracer,
        pool: WorkerThreads,
        backlog: DecodeBacklog,
        limits: preprocess.ImageLimits,
        draining: Callable[[], bool],
        decode_in_batch: bool = False,
    ) -> None:
        self.tracer, self._pool, self._backlog, self._limits, self._draining = tracer, pool, backlog, limits, draining
        self.decode_in_batch = decode_in_batch

    async def predict(
        self,
        served: ServedModel,
        image: bytes | str,
        top_k: int,
        lane: Lane,
        deadline: float,
        request_id: str,
        seat: Seat,
    ) -> Outcome:
        """Decode ``image`` (bytes, or base64 text from a JSON body) on the pool, batch it, run
        it, and label the top ``top_k`` classes, by ``deadline`` (``time.monotonic()``). With
        ``decode_in_batch`` it is only checked here and its batch's device thread decodes it.

        ``seat`` is the request's in its lane, held while the image decodes, given back either
        way. Each stage is a span under the caller's (the HTTP request's) span.
        """
        ids = {"request.id": request_id, "model.name": served.name, "model.version": served.version}
        started = time.perf_counter()
        if self.decode_in_batch:
            payload: torch.Tensor | preprocess.Encoded = self._checked(served, image, ids, seat)
        else:
            payload = await self._decode(served, image, lane, deadline, ids, seat)
        preprocessed = time.perf_counter()
        job = Job(payload, lane, request_id, trace.get_current_span().get_span_context(), deadline)
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
        if time.monotonic() >= deadline:
            # computed, and its task resumed past its deadline (a loop behind runs two dozen answers
            # of a batch one after another): answered as a request past its deadline, not 200 late
            late = DeadlineExceeded("the request's deadline passed before its answer could be sent")
            served.batcher.observer.on_dropped(lane, "late")
            self._inference_span(ids, ran, late).end(end_time=ended_ns)
            raise late
        self._inference_span(ids, ran, None).end(end_time=ended_ns)
        with self.tracer.start_as_current_span("postprocess", attributes=ids):
            predictions = label(top, served.labels, top_k)
        # decoded in its batch: the image's own decode is its preprocessing too, and its inference the
        # rest of the batch's run, its batchmates' decodes included (time it spent in its batch): the
        # stages add up to the time in the app, as with the pool, where every decode is before the queue
        decoded_s = payload.decode_s if isinstance(payload, preprocess.Encoded) else 0.0
        return Outcome(
            served.name,
            served.version,
            predictions,
            lane,
            done.batch_size,
            preprocessed - started + decoded_s,
            done.queued_s,
            max(0.0, done.run_s - decoded_s),
        )

    def _checked(self, served: ServedModel, image: bytes | str, ids: dict[str, str], seat: Seat) -> preprocess.Encoded:
        """The request's image checked as far as costs microseconds, still encoded, for its batch's
        device thread to decode; its seat released either way (queued next, it counts there)."""
        try:
            with self._preprocess_span(ids):
                return preprocess.encoded_payload(image, served.model.manifest.input, self._limits)
        finally:
            seat.release()

    @contextlib.contextmanager
    def _preprocess_span(self, ids: dict[str, str]) -> Iterator[Span]:
        """The request's ``preprocess`` span, ended with what ended the stage: the exception
        recorded, the span failed only for a failure of the service's (a 5xx); a bad upload or a
        client that went is the client's, and Jaeger's error search would list them."""
        with self.tracer.start_as_current_span(
            "preprocess", attributes=ids, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                yield span
            except BaseException as exc:
                _fail(span, exc)
                raise

    async def _decode(
        self, served: ServedModel, image: bytes | str, lane: Lane, deadline: float, ids: dict[str, str], seat: Seat
    ) -> torch.Tensor:
        """The request's image, decoded on the pool by its deadline; its seat released either way."""
        try:
            with self._preprocess_span(ids):
                spec = served.model.manifest.input
                decode = functools.partial(_decode_before, deadline, image, spec, self._limits)
                # answered at its deadline, not when a decode thread is free (a decode that
                # has not started is called off; one that has is not, and its image is dropped)
                expired = functools.partial(served.batcher.observer.on_dropped, lane, "deadline")
                async with within(deadline, "while its image waited to be decoded", expired):
                    tensor, decode_s = await self._pool.run(decode, urgent=lane is Lane.URGENT)
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
            elif job.refused is not None:  # its image did not decode: the client's mistake, whatever the batch's
                exc = job.refused
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
        if isinstance(exc, Draining) and not self._draining():  # its version closed, not the service
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
        if error is not None:  # an image its batch could not decode (a 4xx) is recorded, not a failure
            _fail(span, error)
        return span


def _fail(span: Span, exc: BaseException) -> None:
    """Record why a request's stage ended; fail the span only for what fails the service (a 5xx),
    not the client's mistakes (4xx) or its going away."""
    if isinstance(exc, asyncio.CancelledError):
        span.add_event("client went")
        return
    span.record_exception(exc)
    if fails_the_service(exc):
        code = exc.code if isinstance(exc, ServiceError) else type(exc).__name__
        span.set_status(Status(StatusCode.ERROR, f"{code}: {exc}"))
