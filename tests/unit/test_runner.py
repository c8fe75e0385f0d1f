"""The runner under device faults: out-of-memory splits, pressure reports, the CPU fallback.

No GPU here: a wrapper around the real bundled model raises ``torch.cuda.OutOfMemoryError``
at chosen batch sizes, which is what the CUDA caching allocator raises.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.errors import DeviceUnavailable
from app.inference.device import DeviceThread
from app.inference.loader import LayeredModel
from app.inference.manifest import Manifest
from app.inference.runner import ModelRunner
from tests.faults import Faulty

DIGITS = Path(__file__).resolve().parents[2] / "models" / "digits" / "1"


@pytest.fixture(scope="module")
def model() -> LayeredModel:
    loaded = LayeredModel.load(DIGITS, Manifest.read(DIGITS), torch.device("cpu"), torch.float32)
    loaded.load_all_heads()
    return loaded


def images(model: LayeredModel, n: int) -> list[torch.Tensor]:
    return list(model.dummy_batch(n))


@pytest.fixture
def device() -> DeviceThread:
    thread = DeviceThread("test-device")
    yield thread
    thread.close()


def test_an_oom_batch_is_split_in_halves_and_every_answer_kept(model: LayeredModel, device: DeviceThread) -> None:
    faulty = Faulty(model, fail_at=5)
    pressure: list[int] = []
    runner = ModelRunner(faulty, device, top_k=3, on_pressure=pressure.append)
    batch = images(model, 12)
    answers = runner.run_sync(batch)
    expected = ModelRunner(model, device, top_k=3).run_sync(batch)
    # the same classes in the same order; probabilities equal up to batch-size kernel rounding
    assert [a.indices for a in answers] == [e.indices for e in expected]
    for got, want in zip(answers, expected, strict=True):
        assert got.probabilities == pytest.approx(want.probabilities, abs=1e-5)
    assert faulty.sizes == [12, 6, 3, 3, 6, 3, 3]
    assert pressure == [12, 6, 6]
    assert runner.failures == 0 and not runner.degraded


def test_oom_at_one_image_is_a_device_failure_503(model: LayeredModel, device: DeviceThread) -> None:
    runner = ModelRunner(Faulty(model, always=True), device, top_k=3)
    with pytest.raises(DeviceUnavailable) as failed:
        runner.run_sync(images(model, 2))
    assert failed.value.status == 503 and failed.value.code == "device_unavailable"
    assert runner.failures == 1


def test_without_a_fallback_every_failure_is_503_and_success_resets_the_count(
    model: LayeredModel, device: DeviceThread
) -> None:
    faulty = Faulty(model, always=True)
    runner = ModelRunner(faulty, device, top_k=3, fallback_after=2)
    for expected_failures in (1, 2, 3):
        with pytest.raises(DeviceUnavailable):
            runner.run_sync(images(model, 1))
        assert runner.failures == expected_failures
    faulty.always = False
    runner.run_sync(images(model, 1))
    assert runner.failures == 0 and not runner.degraded


def test_the_cpu_fallback_takes_over_after_repeated_failures(model: LayeredModel, device: DeviceThread) -> None:
    faulty = Faulty(model, always=True)
    loads: list[str] = []

    def fallback() -> LayeredModel:
        loads.append("cpu")
        return model

    runner = ModelRunner(faulty, device, top_k=3, fallback=fallback, fallback_after=2)
    with pytest.raises(DeviceUnavailable):
        runner.run_sync(images(model, 1))
    batch = images(model, 4)
    answers = runner.run_sync(batch)  # the second failure: fall back, and answer this batch
    assert loads == ["cpu"] and runner.degraded and runner.model is model
    assert [a.indices for a in answers] == [e.indices for e in ModelRunner(model, device, top_k=3).run_sync(batch)]
    runner.run_sync(batch)
    assert loads == ["cpu"], "the fallback loads once"


async def test_the_async_call_runs_on_the_device_thread(model: LayeredModel, device: DeviceThread) -> None:
    import threading

    seen: list[str] = []

    class Spy(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return super().probabilities(images, head)

    runner = ModelRunner(Spy(model), device, top_k=2)
    answers = await runner(images(model, 3))
    assert len(answers) == 3 and seen == ["test-device"]


async def test_a_request_past_its_deadline_at_the_device_is_not_computed(
    model: LayeredModel, device: DeviceThread
) -> None:
    import time

    faulty = Faulty(model, fail_at=10_000)  # never fails; records the batch sizes it computes
    runner = ModelRunner(faulty, device, top_k=2)
    now = time.monotonic()
    answers = await runner(images(model, 3), [now + 60, now - 1, now + 60])
    assert answers[1] is None and answers[0] is not None and answers[2] is not None
    assert faulty.sizes == [2], "only the two live images reached the model"
    assert await runner(images(model, 2), [now - 1, now - 1]) == [None, None]
    assert faulty.sizes == [2], "a batch with nothing live never reaches the model"


def test_several_device_workers_run_calls_at_once() -> None:
    import threading

    workers = DeviceThread("pair", workers=2)
    both = threading.Barrier(2, timeout=10)
    try:
        first, second = workers.submit(both.wait), workers.submit(both.wait)
        # each call waits at the barrier for the other: only two threads at once get through
        assert {first.result(10), second.result(10)} == {0, 1}
        assert workers.workers == 2
    finally:
        workers.close()
