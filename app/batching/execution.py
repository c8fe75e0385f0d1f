"""A batch on the runner: each of its requests answered once, then the run counted.

The runner's outputs answer the batch's requests in order; what it raises fails each of them
with the same error (a bug in the runner: a generic ``BatchFailed``, logged once for the batch);
a close that runs out of grace cuts it off. A request whose deadline passed while its batch ran
is answered ``DeadlineExceeded``, never late with the result. Answers come first: counting the batch (the
observer's report, the intake's run-time estimates, the memory ceiling) comes after, and a
failure there costs no request its answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from app.batching.ceiling import Ceiling
from app.batching.clock import Clock
from app.batching.intake import Intake
from app.batching.observer import BatchObserver
from app.batching.policy import BatchPlan, BatchPolicy, Lane
from app.batching.queue import Completed, Pending
from app.errors import BatchFailed, DeadlineExceeded, Draining, ServiceError

log = logging.getLogger(__name__)

P = TypeVar("P")
R = TypeVar("R")

BATCH_RAN_PAST = "the request's deadline passed while its batch ran"

Runner = Callable[[Sequence[P]], Awaitable[Sequence[R]]]
"""Runs one batch: one output per input, in order. Raising fails exactly that batch."""


class Execution(Generic[P, R]):
    """Runs the batches a ``DualWindowBatcher`` forms on ``runner``, and counts them."""

    def __init__(
        self,
        runner: Runner[P, R],
        *,
        clock: Clock,
        observer: BatchObserver,
        intake: Intake,
        ceiling: Ceiling,
        policy: Callable[[], BatchPolicy],
        name: str,
        computed: Callable[[Sequence[R]], int],
        model_epoch: Callable[[], int],
    ) -> None:
        """``policy()`` is the batcher's policy now; ``computed`` and ``model_epoch`` are as the
        batcher takes them (see ``DualWindowBatcher``)."""
        self._runner = runner
        self._clock = clock
        self._observer = observer
        self._intake = intake
        self._ceiling = ceiling
        self._policy = policy
        self._name = name
        self._computed = computed
        self._model_epoch = model_epoch
        self.batches = 0
        self.cut = 0  # requests the close cut off uncomputed (its grace ran out)

    async def run(self, plan: BatchPlan, batch: list[Pending[P, R]], capacity: int) -> None:
        """Run ``batch``, formed as ``plan`` says, and answer each of its requests once;
        ``capacity`` is the batch size its fill is reported against."""
        started = self._clock.now()
        epoch = self._model_epoch()
        self.batches += 1
        try:
            outputs = await self._runner([item.payload for item in batch])
            if len(outputs) != len(batch):
                raise BatchFailed(f"runner returned {len(outputs)} outputs for {len(batch)} inputs")
        except asyncio.CancelledError:  # closing ran out of grace mid-batch
            self.cut_off(batch, Draining("the service shut down while this request ran"))
            return
        except ServiceError as exc:
            error: BaseException = exc
        except Exception as exc:  # a bug in the runner: fail exactly this batch, keep serving
            error = self._bug(batch, exc)
        except BaseException as exc:  # an abort through the runner: its requests are answered, then it goes on up
            self._fail(batch, self._bug(batch, exc))
            raise
        else:
            now = self._clock.now()
            run_s = now - started
            # those the device ran: not the ones it left out (gone, or past their deadline)
            computed = self._computed(outputs)
            self._answer(plan.lane, batch, outputs, computed or len(batch), started, now)
            try:  # answered first: a failure in what is counted after must not cost them their answers
                self._after_success(plan, batch, computed, started, run_s, capacity, epoch)
            except Exception:
                log.exception("counting a batch of %d that ran failed in %s", len(batch), self._name)
            return
        self._fail(batch, error)
        try:  # answered first, as a batch that ran is
            self._report(plan, batch, started, self._clock.now() - started, capacity, len(batch), ok=False)
        except Exception:
            log.exception("counting a batch of %d that failed failed in %s", len(batch), self._name)

    def _answer(
        self, lane: Lane, batch: Sequence[Pending[P, R]], outputs: Sequence[R], ran: int, started: float, now: float
    ) -> None:
        """Each request of a batch that ran its output, unless answered already or past its
        deadline now: one the device computed for nobody is counted (``late``)."""
        for item, output in zip(batch, outputs, strict=True):
            if item.future.done():
                if _expired(item) and self._computed([output]):  # its timer ran while the device computed it
                    self._observer.on_dropped(item.lane, "late")
                continue
            if item.deadline <= now:
                # its deadline passed while the batch ran, and its timer has not run yet (a busy loop
                # runs timers late, after the batch's result that came in before it): it is answered
                # as its timer would have answered it, not late with the result
                item.future.set_exception(DeadlineExceeded(BATCH_RAN_PAST))
                if self._computed([output]):  # (one the device left out is counted there)
                    self._observer.on_dropped(item.lane, "late")
                continue
            item.future.set_result(Completed(output, item.lane, lane, ran, started - item.enqueued_at, now - started))

    def _bug(self, batch: Sequence[Pending[P, R]], exc: BaseException) -> BatchFailed:
        """The error a batch's requests get for what the runner raised that is no service error: a
        generic one (their 500 shows no internals), the detail logged once for the batch, with
        what the runner gave to lead to it (``log_fields``: its requests' ids, its trace)."""
        extra = getattr(exc, "log_fields", None)
        log.error("batch of %d failed in %s", len(batch), self._name, exc_info=exc, extra=extra)
        error = BatchFailed("inference failed")
        error.__cause__, error.logged = exc, True
        return error

    def _after_success(
        self,
        plan: BatchPlan,
        batch: Sequence[Pending[P, R]],
        computed: int,
        started: float,
        run_s: float,
        capacity: int,
        epoch: object,
    ) -> None:
        """A batch ran, ``computed`` of its requests: its time in the estimates, its report, and
        the ceiling's recovery."""
        if self._model_epoch() != epoch:  # another model now: estimates start again, from its batches
            self._intake.forget_batches()
            self._ceiling.reset()  # and the old device's memory pressure no longer caps them
        elif computed:
            self._intake.observe_batch(plan.lane, run_s)
        self._report(plan, batch, started, run_s, capacity, computed, ok=True)
        self._ceiling.calm(computed, self._policy())

    def _report(
        self,
        plan: BatchPlan,
        batch: Sequence[Pending[P, R]],
        started: float,
        run_s: float,
        capacity: int,
        size: int,
        ok: bool,
    ) -> None:
        """The batch's figures: ``size`` is what the device ran of a batch that ran (0: none, its
        requests gone or undecodable before it took them), the batch as formed for one that failed."""
        waits = [(item.lane, started - item.enqueued_at) for item in batch]
        self._observer.on_batch(plan.lane, size, capacity, waits, run_s, ok)

    @staticmethod
    def _fail(batch: Sequence[Pending[P, R]], error: BaseException) -> None:
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error)

    def cut_off(self, items: Sequence[Pending[P, R]], error: BaseException) -> None:
        """Fail the requests the close leaves uncomputed, and count each once: taken from the queue
        or cut off on the device, nothing else will (the batcher's ``_settled`` skips what was
        taken, and the device counts only what it ran). One already gone (its client, its
        deadline) counts so."""
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)
                self._observer.on_dropped(item.lane, "cancelled")
                self.cut += 1
            elif item.future.cancelled():
                self._observer.on_dropped(item.lane, "cancelled")
            elif isinstance(item.future.exception(), DeadlineExceeded):
                self._observer.on_dropped(item.lane, "deadline")


def _expired(item: Pending[P, R]) -> bool:
    """Whether ``item`` was answered ``deadline_exceeded`` (by its timer)."""
    return not item.future.cancelled() and isinstance(item.future.exception(), DeadlineExceeded)
