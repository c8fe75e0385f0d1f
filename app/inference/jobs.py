"""What rides in a batch, and the batch runner that traces each batch.

The batcher is generic over its payload; the service sends ``Job``s, which carry the image
and what a trace needs (the request's span context and id). ``TracedRunner`` wraps the
model runner: one ``batch`` span per batch, linked to every member request's span.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, Status, StatusCode

from app.batching import Lane
from app.batching.observer import BatchObserver, NullObserver
from app.errors import ServiceError, fails_the_service
from app.inference.postprocess import TopK
from app.inference.preprocess import Encoded
from app.inference.runner import ModelRunner


@dataclass(slots=True)
class Job:
    image: torch.Tensor | Encoded  # decoded already, or by the device thread that runs its batch
    lane: Lane
    request_id: str
    span_context: SpanContext | None
    deadline: float = float("inf")  # time.monotonic(); checked again just before compute
    gone: bool = False  # set on the event loop when its client went; read on the device thread
    left_out: bool = False  # not computed, its client gone or its deadline past, in a batch that failed
    refused: ServiceError | None = None  # its image did not decode, in a batch that then failed
    batch: BatchTrace | None = None  # its batch, once one runs it (set on the event loop)


@dataclass(frozen=True)
class BatchTrace:
    """Where a request's batch is in the traces: its span, when it started, its size and lane."""

    span: SpanContext
    started_ns: int
    size: int
    lane: Lane


def _batch_log_fields(ran: BatchTrace, jobs: Sequence[Job]) -> dict[str, object]:
    """What the line logging a failed batch's traceback (``Execution``'s, once the batch's span
    has ended) carries to lead to it: its requests' ids, and its span where spans are exported."""
    fields: dict[str, object] = {"request_ids": [job.request_id for job in jobs]}
    if ran.span.is_valid:
        fields["trace_id"], fields["span_id"] = format(ran.span.trace_id, "032x"), format(ran.span.span_id, "016x")
    return fields


def batch_trace_of(error: BaseException) -> BatchTrace | None:
    """The batch a whole-batch failure came from (the batcher may wrap it: then its cause)."""
    for candidate in (error, error.__cause__):
        found = getattr(candidate, "batch_trace", None)
        if isinstance(found, BatchTrace):
            return found
    return None


@dataclass(frozen=True)
class Answer:
    """One image's top classes (``None``: left out at the device, its deadline passed or its
    client gone; an error: its image did not decode, or the device failed it while it computed
    others, or its output was not finite), and the span of the batch that computed it (for a
    link back)."""

    top: TopK | ServiceError | None
    batch_span: SpanContext
    started_ns: int  # the batch's run, in wall-clock ns: every request of it shows the same times
    ended_ns: int


def reached_the_device(answer: Answer) -> bool:
    """Whether the device took ``answer``'s image, computed or failed there: not one left out,
    nor one that did not decode (a 4xx; a batch of those alone ran no forward pass, and its time
    would drag the lane's run-time estimate down)."""
    return _reached(answer.top)


def _reached(top: TopK | ServiceError | None) -> bool:
    return top is not None and (not isinstance(top, ServiceError) or fails_the_service(top))


class TracedRunner:
    """The batcher's runner: one ``batch`` span around the model runner."""

    def __init__(
        self,
        runner: ModelRunner,
        tracer: trace.Tracer,
        model: str,
        version: str,
        dtype: str,
        observer: BatchObserver | None = None,
    ) -> None:
        self.runner = runner
        self._tracer = tracer
        self._observer = observer or NullObserver()  # counts the jobs left out at the device
        self._attributes = {"model.name": model, "model.version": version}
        self._dtype = dtype

    def _served_by(self) -> dict[str, str]:
        """Where batches run now: the configured device and precision, or the CPU fallback's fp32."""
        return {
            "device": str(self.runner.model.device),
            "model.dtype": "float32" if self.runner.degraded else self._dtype,
        }

    async def __call__(self, jobs: Sequence[Job]) -> list[Answer]:
        links = [Link(job.span_context) for job in jobs if job.span_context is not None and job.span_context.is_valid]
        lane = Lane.URGENT if any(job.lane is Lane.URGENT for job in jobs) else Lane.NORMAL
        attributes = {
            **self._attributes,
            "batch.size": len(jobs),
            "batch.lane": lane.value,
            **self._served_by(),
            "request.ids": [job.request_id for job in jobs],
        }
        started_ns = time.time_ns()
        # the context manager records an exception and marks the span as failed
        with self._tracer.start_as_current_span("batch", links=links, attributes=attributes) as span:
            ran = BatchTrace(span.get_span_context(), started_ns, len(jobs), lane)
            for job in jobs:  # a request that ends while its batch runs (deadline, client gone) leads here
                job.batch = ran
            try:
                tops = await self.runner(
                    [job.image for job in jobs],
                    [job.deadline for job in jobs],
                    urgent=lane is Lane.URGENT,
                    riders=lane is Lane.URGENT and any(job.lane is Lane.NORMAL for job in jobs),
                    gone=lambda i: jobs[i].gone,
                    ids=lambda i: jobs[i].request_id,  # read only by a failure's log line
                )
            except Exception as exc:  # the whole batch failed: each request's trace leads to it
                exc.batch_trace = ran  # type: ignore[attr-defined]
                exc.log_fields = _batch_log_fields(ran, jobs)  # type: ignore[attr-defined]
                for i in getattr(exc, "left_out", ()):  # those the device left out failed with nothing
                    jobs[i].left_out = True
                    self._observer.on_dropped(jobs[i].lane, "cancelled" if jobs[i].gone else "deadline")
                for i, error in getattr(exc, "refused", {}).items():  # their images did not decode
                    jobs[i].refused = error
                raise
            if self.runner.degraded:  # the CPU fallback may have taken over during this batch: it computed it
                span.set_attributes(self._served_by())
            context = span.get_span_context()
            if span.is_recording():  # the requests' own spans and answers give this, not batch.size
                span.set_attribute("batch.computed", sum(_reached(top) for top in tops))
            # an image that did not decode is its client's mistake (4xx): not the batch's failure
            failed = sum(isinstance(top, ServiceError) and fails_the_service(top) for top in tops)
            if failed:
                span.set_status(Status(StatusCode.ERROR, f"{failed} of {len(jobs)} images failed"))
        for job, top in zip(jobs, tops, strict=True):
            if top is None:  # left out at the device: its client went, or its deadline passed
                self._observer.on_dropped(job.lane, "cancelled" if job.gone else "deadline")
        ended_ns = time.time_ns()
        return [Answer(top, context, started_ns, ended_ns) for top in tops]
