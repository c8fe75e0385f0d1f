"""Batching policy and the pure rules that decide when a batch forms and what rides in it.

These functions see only counts and times, never futures or payloads, so they can be
checked exhaustively with property tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Lane(enum.StrEnum):
    """Which queue a request waits in: ``urgent`` (short window) or ``normal``."""

    URGENT = "urgent"
    NORMAL = "normal"


_MODES = "must be always, backlog or never (or true / false)"  # what an urgent_fill that is none says


class UrgentFill(enum.StrEnum):
    """When an urgent batch takes its free seats from the head of the normal queue.

    Seats filled make the batch cheaper per image (a batch of one costs about three images'
    time in a batch of twelve on a CPU) and the urgent batch longer. ``backlog`` fills only
    while the normal requests admitted and not yet running (queued, or still on their way:
    their images decoding) make ``urgent_fill_backlog`` full batches for every device thread,
    that is while the service is behind and throughput is what the normal lane lacks; under
    lighter load urgent batches stay small and fast. A filled urgent batch runs as long as a
    full normal one, and an urgent request arriving meanwhile waits for it; near saturation the
    normal lane's bursts make one batch's backlog often, and a larger ``urgent_fill_backlog``
    keeps them from filling urgent batches. While the normal lane refuses requests (overload:
    it is as far behind as admission lets it be), one full batch per device thread is enough
    whatever ``urgent_fill_backlog`` says: a short deadline caps the backlog admission lets in,
    and under overload the riders' throughput is what the service lacks.
    """

    ALWAYS = "always"
    BACKLOG = "backlog"
    NEVER = "never"

    @classmethod
    def parse(cls, value: object) -> UrgentFill:
        """A mode's name (any case), or ``true``/``false`` (booleans or their spellings) as
        ``always``/``never``; ``ValueError``, naming the modes, for anything else (a strict
        validation, the admin API's, said only "an instance of UrgentFill" of a null or a number).
        The mode itself, not its name: a strict validation takes nothing else."""
        if isinstance(value, bool):
            return cls.ALWAYS if value else cls.NEVER
        if not isinstance(value, str):
            raise ValueError(_MODES)
        spelled = value.strip().lower()
        if spelled in ("true", "false"):
            return cls.ALWAYS if spelled == "true" else cls.NEVER
        if spelled in cls._value2member_map_:
            return cls(spelled)
        raise ValueError(_MODES)


@dataclass(frozen=True)
class LanePolicy:
    """One lane's rules: a batch goes when it holds ``max_batch`` or its oldest waited ``window_s``
    (at once for a request whose deadline cannot wait that long: see ``hurries``)."""

    window_s: float
    max_batch: int
    max_queue: int

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError("window_s must be > 0")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.max_queue < self.max_batch:
            raise ValueError("max_queue must be >= max_batch")


@dataclass(frozen=True)
class BatchPolicy:
    """Both lanes, when an urgent batch fills its free seats from the normal queue, and the
    share of a request's remaining time that its predicted wait may take at admission."""

    urgent: LanePolicy
    normal: LanePolicy
    urgent_fill: UrgentFill = UrgentFill.ALWAYS
    admission_headroom: float = 1.0
    urgent_fill_backlog: int = 1  # under ``backlog``: full normal batches waiting per batch in flight

    @property
    def largest_batch(self) -> int:
        """The biggest batch either lane may form."""
        return max(self.urgent.max_batch, self.normal.max_batch)

    def __post_init__(self) -> None:
        if not 0 < self.admission_headroom <= 1:
            raise ValueError("admission_headroom must be in (0, 1]")
        if self.urgent_fill_backlog < 1:
            raise ValueError("urgent_fill_backlog must be >= 1")

    def lane(self, lane: Lane) -> LanePolicy:
        return self.urgent if lane is Lane.URGENT else self.normal


@dataclass(frozen=True)
class LaneState:
    """What the rules need to know of a queue: live requests, when the oldest arrived, and whether
    one of them cannot wait out the window (``hurries``: the lane's batch goes at once)."""

    waiting: int = 0
    oldest_at: float | None = None
    hurried: bool = False


@dataclass(frozen=True)
class BatchPlan:
    """A batch to dispatch: its lane and how many to take from the head of each queue."""

    lane: Lane
    from_urgent: int
    from_normal: int

    @property
    def size(self) -> int:
        return self.from_urgent + self.from_normal


def ready_at(state: LaneState, policy: LanePolicy) -> float | None:
    """When the lane's window closes for its oldest request, or when it arrived, if a request
    queued cannot wait out the window (``None`` if it is empty)."""
    if state.waiting == 0 or state.oldest_at is None:
        return None
    return state.oldest_at if state.hurried else state.oldest_at + policy.window_s


HURRY_BATCHES = 4


def hurries(timeout_s: float, window_s: float, batch_s: float | None) -> bool:
    """Whether a request with ``timeout_s`` left cannot wait out its lane's window: its deadline is
    less than the window and ``HURRY_BATCHES`` batches' runs away (the window alone, before the
    lane's first batch is timed). Its lane's batch then goes at once, with whatever is queued, as
    soon as a device thread may take it, and its admission leaves the window out of its predicted
    wait. Waiting for company until it must start would leave it only the margin of an estimate,
    which a loop running late or a slower batch spends. Under the default deadline (30 s) no
    request hurries."""
    return timeout_s < window_s + (0.0 if batch_s is None else HURRY_BATCHES * batch_s)


def is_ready(state: LaneState, policy: LanePolicy, now: float, flush: bool = False) -> bool:
    """Full, or its oldest request has waited the window, or one cannot wait it out (or
    everything goes: ``flush``)."""
    if state.waiting == 0:
        return False
    if flush or state.waiting >= policy.max_batch:
        return True
    deadline = ready_at(state, policy)
    return deadline is not None and now >= deadline


def fills(policy: BatchPolicy, backlog: int, backlog_batches: int = 1, refusing: bool = False) -> bool:
    """Whether an urgent batch formed now takes free seats from the normal queue; ``backlog``
    fills while the ``backlog`` normal requests admitted ahead make ``policy.urgent_fill_backlog`` full
    batches for each of the ``backlog_batches`` the device runs at once (every device thread has
    that many full batches coming), or one full batch each while the normal lane is ``refusing``."""
    if policy.urgent_fill is UrgentFill.BACKLOG:
        batches = 1 if refusing else policy.urgent_fill_backlog
        return backlog >= policy.normal.max_batch * backlog_batches * batches
    return policy.urgent_fill is UrgentFill.ALWAYS


def plan_batch(
    urgent: LaneState,
    normal: LaneState,
    policy: BatchPolicy,
    now: float,
    flush: bool = False,
    backlog_batches: int = 1,
    riders: bool = True,
    normal_backlog: int = 0,
    due_riders: bool = False,
    refusing: bool = False,
) -> BatchPlan | None:
    """The next batch to run, urgent first; ``None`` when no lane is ready.

    ``riders=False`` keeps normal requests out of an urgent batch under the ``always`` rule: the
    batcher passes it when the urgent requests have already waited for a busy device thread
    (one running a filled urgent batch, say), so none of them waits for two long batches. Under
    ``backlog`` the seats fill whenever the rule holds: the service is behind, and throughput
    comes first. ``normal_backlog`` is how many normal requests were admitted and are not
    queued yet (their images decoding): the fill rule's backlog is those and the queue's.
    ``due_riders``: the urgent batch takes the device a normal batch would have had (they share
    it, and it is the last free one), so a normal lane whose window has closed rides in its free
    seats whatever the fill rule: under steady urgent traffic it would otherwise never run.
    ``refusing``: the normal lane refuses requests now (see ``fills``).
    """
    if is_ready(urgent, policy.urgent, now, flush):
        take = min(urgent.waiting, policy.urgent.max_batch)
        seats = policy.urgent.max_batch - take
        takes_riders = riders or policy.urgent_fill is UrgentFill.BACKLOG
        backlog = normal.waiting + normal_backlog
        rule = takes_riders and fills(policy, backlog, backlog_batches, refusing)
        due = due_riders and is_ready(normal, policy.normal, now, flush)
        fill = min(seats, normal.waiting) if rule or due else 0
        return BatchPlan(Lane.URGENT, take, fill)
    if is_ready(normal, policy.normal, now, flush):
        return BatchPlan(Lane.NORMAL, 0, min(normal.waiting, policy.normal.max_batch))
    return None


def next_wakeup(urgent: LaneState, normal: LaneState, policy: BatchPolicy) -> float | None:
    """The earliest time a lane becomes ready by its window, if nothing else arrives."""
    times = [t for t in (ready_at(urgent, policy.urgent), ready_at(normal, policy.normal)) if t is not None]
    return min(times) if times else None
