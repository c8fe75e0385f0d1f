"""The interpreter tuned for serving: applied at start, the GC frozen once warm, all restored at close."""

from __future__ import annotations

import gc
import shutil
import sys
import weakref
from pathlib import Path

from app.interpreter import Tuning
from app.service import InferenceService
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


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
