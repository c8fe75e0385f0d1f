"""The interpreter tuned for serving: applied at start, the GC frozen once warm, all restored at close."""

from __future__ import annotations

import gc
import shutil
import sys
from pathlib import Path

from app.interpreter import Tuning
from app.service import InferenceService
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_apply_sets_and_restore_puts_back() -> None:
    before_interval, before_threshold = sys.getswitchinterval(), gc.get_threshold()
    saved = Tuning(switch_interval_s=0.0003, gc_freeze=True, gc_young_threshold=12_345).apply()
    try:
        assert sys.getswitchinterval() == 0.0003
        assert gc.get_threshold() == (12_345, *before_threshold[1:])
    finally:
        saved.restore()
    assert sys.getswitchinterval() == before_interval and gc.get_threshold() == before_threshold


def test_freeze_moves_live_objects_out_of_the_collector_and_restore_returns_them() -> None:
    tuning = Tuning(switch_interval_s=sys.getswitchinterval(), gc_freeze=True, gc_young_threshold=0)
    saved = tuning.apply()
    alive = [[n] for n in range(1000)]  # containers the collector tracks
    tuning.freeze()
    try:
        assert gc.get_freeze_count() >= len(alive)
    finally:
        saved.restore()
    assert gc.get_freeze_count() == 0


def test_freeze_off_leaves_the_collector_alone() -> None:
    tuning = Tuning(switch_interval_s=sys.getswitchinterval(), gc_freeze=False, gc_young_threshold=0)
    before = gc.get_threshold()
    saved = tuning.apply()
    tuning.freeze()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    saved.restore()


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
