"""The interpreter tuned for serving: applied at start, the GC frozen once warm, all restored at close."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import platform
import shutil
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from app.batching import Lane
from app.interpreter import Tuning, no_wakeup_preemption, short_time_slice
from app.service import InferenceService
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")


class _Node:
    """A container in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_apply_sets_and_restore_puts_back() -> None:
    before_interval, before_threshold = sys.getswitchinterval(), gc.get_threshold()
    tuning = Tuning(switch_interval_s=0.0003, gc_freeze=True, gc_young_threshold=12_345)
    tuning.apply()
    try:
        assert sys.getswitchinterval() == 0.0003
        assert gc.get_threshold() == (12_345, *before_threshold[1:])
    finally:
        tuning.restore()
    assert sys.getswitchinterval() == before_interval and gc.get_threshold() == before_threshold


def test_freeze_moves_live_objects_out_of_the_collector_and_restore_returns_them() -> None:
    tuning = Tuning(switch_interval_s=sys.getswitchinterval(), gc_freeze=True, gc_young_threshold=0)
    tuning.apply()
    alive = [[n] for n in range(1000)]  # containers the collector tracks
    tuning.freeze()
    try:
        assert gc.get_freeze_count() >= len(alive)
    finally:
        tuning.restore()
    assert gc.get_freeze_count() == 0


def test_a_cycle_frozen_then_dropped_is_freed_by_collect_unloaded_only() -> None:
    tuning = Tuning(switch_interval_s=sys.getswitchinterval(), gc_freeze=True, gc_young_threshold=0)
    tuning.apply()
    node = _Node()
    ref = weakref.ref(node)
    tuning.freeze()
    try:
        del node
        gc.collect()
        assert ref() is not None, "a frozen cycle outlives a plain collection"
        tuning.collect_unloaded()
        assert ref() is None
        assert gc.get_freeze_count() > 0, "frozen again afterwards"
    finally:
        tuning.restore()


def test_restore_unfreezes_only_what_it_froze() -> None:
    tuning = Tuning(switch_interval_s=sys.getswitchinterval(), gc_freeze=True, gc_young_threshold=0)
    tuning.apply()  # start-up failed before warm-up: no freeze
    gc.freeze()  # somebody else's
    try:
        tuning.restore()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_freeze_off_leaves_the_collector_alone() -> None:
    tuning = Tuning(switch_interval_s=sys.getswitchinterval(), gc_freeze=False, gc_young_threshold=0)
    before = gc.get_threshold()
    tuning.apply()
    tuning.freeze()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    tuning.restore()


async def test_the_service_freezes_once_its_models_are_warm_and_restores_at_close(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    before = gc.get_threshold()
    settings = Settings(
        model={"repository": tmp_path, "warmup": False},  # type: ignore[arg-type]
        server={"gc_young_threshold": 4321},  # type: ignore[arg-type]
    )
    service = InferenceService(settings)
    assert gc.get_freeze_count() == 0
    await service.start()
    try:
        assert service.ready and gc.get_freeze_count() > 0 and gc.get_threshold()[0] == 4321
    finally:
        await service.close(0)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def _policy(thread_id: int = 0) -> int:
    return os.sched_getscheduler(thread_id)


def _on_a_thread(work: Callable[[], T]) -> T:
    """``work`` on a fresh thread: a scheduling policy set there ends with it, whatever fails."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result(10)


@linux_only
def test_without_wakeup_preemption_the_loops_thread_runs_as_batch_until_restored() -> None:
    def serve_and_close() -> tuple[int, int, int]:
        before = _policy()
        tuning = Tuning(sys.getswitchinterval(), gc_freeze=False, gc_young_threshold=0, wakeup_preemption=False)
        tuning.apply()
        serving = _policy()
        tuning.restore()
        return before, serving, _policy()

    assert _on_a_thread(serve_and_close) == (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_OTHER)


@linux_only
def test_with_wakeup_preemption_the_scheduling_is_left_alone() -> None:
    def serve_and_close() -> tuple[int, int]:
        tuning = Tuning(sys.getswitchinterval(), gc_freeze=False, gc_young_threshold=0, wakeup_preemption=True)
        tuning.apply()
        serving = _policy()
        tuning.restore()
        return serving, _policy()

    assert _on_a_thread(serve_and_close) == (os.SCHED_OTHER, os.SCHED_OTHER)


@linux_only
def test_a_policy_its_operator_set_is_not_changed() -> None:
    def idle_then_tuned() -> tuple[int | None, int]:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # e.g. started under chrt --idle
        return no_wakeup_preemption(), _policy()

    assert _on_a_thread(idle_then_tuned) == (None, os.SCHED_IDLE)


@linux_only
async def test_the_service_schedules_its_loops_thread_as_batch_not_its_worker_threads(
    tmp_path: Path,
) -> None:
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    for preempting in (False, True):
        settings = Settings(
            model={"repository": tmp_path, "warmup": False, "urgent_workers": 1},  # type: ignore[arg-type]
            server={"wakeup_preemption": preempting},  # type: ignore[arg-type]
        )
        service = InferenceService(settings)
        await service.start()
        try:
            loop, decode = _policy(), {_policy(t.native_id or 0) for t in service._pool._threads}
            device = {_policy(t.native_id or 0) for t in service._device_thread._threads}
        finally:
            await service.close(0)
        batch = os.SCHED_OTHER if preempting else os.SCHED_BATCH
        assert (loop, decode, device) == (batch, {os.SCHED_OTHER}, {os.SCHED_OTHER}), f"preemption={preempting}"
        assert _policy() == os.SCHED_OTHER, "the loop's thread is given back as it was"


@linux_only
def test_while_an_urgent_request_is_in_flight_the_loop_pre_empts_again() -> None:
    def serve_urgent_twice() -> list[int]:
        tuning = Tuning(sys.getswitchinterval(), gc_freeze=False, gc_young_threshold=0, wakeup_preemption=False)
        tuning.apply()
        seen = [_policy()]
        tuning.urgent_began()
        tuning.urgent_began()  # a second one overlapping the first
        seen.append(_policy())
        tuning.urgent_ended()
        seen.append(_policy())  # one is still in flight
        tuning.urgent_ended()
        seen.append(_policy())
        tuning.urgent_began()  # one in flight at the close: given back all the same
        tuning.restore()
        tuning.urgent_ended()  # answered after the close: changes nothing
        return [*seen, _policy()]

    other, batch = os.SCHED_OTHER, os.SCHED_BATCH
    assert _on_a_thread(serve_urgent_twice) == [batch, other, other, batch, other]


@linux_only
async def test_the_service_pre_empts_while_an_urgent_prediction_is_in_flight_only(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    settings = Settings(model={"repository": tmp_path, "warmup": False})  # type: ignore[arg-type]
    service = InferenceService(settings)
    await service.start()
    image = (ROOT / "models" / "digits" / "samples" / "digit_3.png").read_bytes()
    gate = threading.Event()
    try:
        seen = {}
        for lane in (Lane.NORMAL, Lane.URGENT):
            for _ in range(service._pool.workers):  # every decode thread held: the request stays in flight
                service._pool.submit(gate.wait)
            served = service.served(None)
            prediction = asyncio.ensure_future(service.predict(served, image, 1, lane, 30.0))
            await asyncio.sleep(0)  # it starts, and waits for a decode thread
            seen[lane] = _policy()
            gate.set()
            assert (await prediction).predictions[0].label == "3"
            gate.clear()
        assert seen == {Lane.NORMAL: os.SCHED_BATCH, Lane.URGENT: os.SCHED_OTHER}
        assert _policy() == os.SCHED_BATCH, "with nothing urgent in flight, the loop waits its turn again"
    finally:
        gate.set()
        await service.close(0)


@linux_only
def test_urgent_requests_and_the_close_on_another_thread_change_only_the_tuned_threads_policy() -> None:
    """The service tuned on one thread and serving or closing on another (an embedder's loops):
    the urgent toggles and the close act on the thread ``apply`` tuned, and leave the caller's
    policy as it was (before, an urgent request left its caller's thread ``SCHED_BATCH`` for good)."""
    tuning = Tuning(sys.getswitchinterval(), gc_freeze=False, gc_young_threshold=0, wakeup_preemption=False)
    tuned, done = threading.Event(), threading.Event()
    native: list[int] = []

    def loop_thread() -> None:
        tuning.apply()
        native.append(threading.get_native_id())
        tuned.set()
        done.wait(10)

    with ThreadPoolExecutor(1) as loop:
        running = loop.submit(loop_thread)
        try:
            assert tuned.wait(10)
            seen: list[tuple[int, int]] = []

            def serve_urgent_then_close() -> None:
                tuning.urgent_began()
                seen.append((_policy(native[0]), _policy()))
                tuning.urgent_ended()
                seen.append((_policy(native[0]), _policy()))
                tuning.restore()
                seen.append((_policy(native[0]), _policy()))

            _on_a_thread(serve_urgent_then_close)
        finally:
            done.set()
            running.result(10)
    other, batch = os.SCHED_OTHER, os.SCHED_BATCH
    assert seen == [(other, other), (batch, other), (other, other)]


@linux_only
async def test_a_close_cut_short_still_gives_the_loops_thread_back(tmp_path: Path) -> None:
    """Cancelled while it drains (a second Ctrl-C, an embedder's timeout), the close still puts
    back the loop thread's scheduling: left batch, the thread and every thread it starts after
    would wait for time slices for the rest of the process."""
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    service = InferenceService(Settings(model={"repository": tmp_path, "warmup": False}))  # type: ignore[arg-type]
    await service.start()
    image = (ROOT / "models" / "digits" / "samples" / "digit_3.png").read_bytes()
    gate = threading.Event()
    try:
        for _ in range(service._pool.workers):  # every decode thread held: the prediction stays in flight
            service._pool.submit(gate.wait)
        prediction = asyncio.ensure_future(service.predict(service.served(None), image, 1, Lane.NORMAL, 30.0))
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(service.close(None))  # no grace: it waits for the prediction
        await asyncio.sleep(0.05)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert _policy() == os.SCHED_OTHER
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # whatever the close left
        gate.set()
        await asyncio.gather(prediction, return_exceptions=True)
        await service.close(0)


def _time_slice(thread_id: int = 0) -> int:
    """The thread's time slice under the fair scheduler, in ns (sched_getattr(2), x86-64)."""
    attr = ctypes.create_string_buffer(48)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(ctypes.c_long(315), ctypes.c_int(thread_id), attr, ctypes.c_uint(48), ctypes.c_uint(0)) == 0
    return int(struct.unpack_from("=IIQiIQ", attr.raw)[5])


def _custom_slices() -> bool:
    """Whether this kernel keeps a thread's own slice (EEVDF's, Linux 6.12+): tried on a throwaway thread."""
    return _on_a_thread(lambda: short_time_slice(300_000) and _time_slice() == 300_000)


custom_slices = pytest.mark.skipif(
    platform.machine() != "x86_64" or not hasattr(os, "SCHED_BATCH"), reason="sched_getattr read as on x86-64 Linux"
)


@custom_slices
def test_a_short_time_slice_keeps_the_threads_nice_value() -> None:
    if not _custom_slices():
        pytest.skip("this kernel keeps no slice of a thread's own (Linux before 6.12)")

    def niced_then_sliced() -> tuple[bool, int, int]:
        me = threading.get_native_id()
        niced = min(19, os.getpriority(os.PRIO_PROCESS, me) + 3)
        os.setpriority(os.PRIO_PROCESS, me, niced)
        return short_time_slice(150_000), _time_slice(), os.getpriority(os.PRIO_PROCESS, me) - niced

    assert _on_a_thread(niced_then_sliced) == (True, 150_000, 0)


@custom_slices
def test_a_thread_of_another_policy_keeps_its_slice() -> None:
    def batch_then_sliced() -> tuple[bool, bool]:
        before = _time_slice()
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # as the loop's thread runs, or an operator set
        return short_time_slice(150_000), _time_slice() == before

    assert _on_a_thread(batch_then_sliced) == (False, True)


@custom_slices
async def test_the_services_urgent_device_thread_alone_runs_a_short_slice(tmp_path: Path) -> None:
    if not _custom_slices():
        pytest.skip("this kernel keeps no slice of a thread's own (Linux before 6.12)")
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    default = _on_a_thread(_time_slice)
    for slice_ms, urgent_slice in ((0.25, 250_000), (0, default)):
        settings = Settings(
            model={"repository": tmp_path, "warmup": False, "urgent_workers": 1, "urgent_slice_ms": slice_ms},  # type: ignore[arg-type]
        )
        service = InferenceService(settings)
        await service.start()
        try:
            slices = {t.name: _time_slice(t.native_id or 0) for t in service._device_thread._threads}
            decode = {_time_slice(t.native_id or 0) for t in service._pool._threads}
        finally:
            await service.close(0)
        urgent = {name: value for name, value in slices.items() if "urgent" in name}
        assert list(urgent.values()) == [urgent_slice], (slice_ms, slices)
        assert {value for name, value in slices.items() if name not in urgent} == {default}, slices
        assert decode == {default} and _time_slice() == default, "no other thread's slice changes"
