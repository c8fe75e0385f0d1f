"""The runner under device faults: out-of-memory splits, pressure reports, the CPU fallback.

No GPU here: a wrapper around the real bundled model raises ``torch.cuda.OutOfMemoryError``
at chosen batch sizes, which is what the CUDA caching allocator raises.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from opentelemetry import trace
from torch import nn

from app.batching import Lane
from app.errors import BatchFailed, DeviceUnavailable, Unavailable
from app.inference import loader
from app.inference.device import DeviceThread, Fault, device_fault, fault_line
from app.inference.jobs import Job, TracedRunner
from app.inference.loader import LayeredModel, ModelLoadError, PreparedLayer
from app.inference.manifest import Layer, Manifest, Provenance
from app.inference.packaging import write_version
from app.inference.postprocess import TopK
from app.inference.runner import ModelRunner
from app.training.digits import make_backbone
from tests.faults import DeviceLost, Faulty, LostAfter, Unfit, out_of_memory_in_graph
from tests.support import DIGITS_DIR, LABELS, MODEL_NAME

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


class Broken:
    """A model with a bug: every forward pass raises an error that is not the device's."""

    def __init__(self, inner: LayeredModel) -> None:
        self.inner, self.manifest, self.device, self.dtype = inner, inner.manifest, inner.device, inner.dtype
        self.failed_heads, self.unreadable_heads = inner.failed_heads, inner.unreadable_heads

    def batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        return self.inner.batch(images)

    def batch_rows(self, images: int) -> int:
        return self.inner.batch_rows(images)

    def head(self, name: str | None = None) -> torch.jit.ScriptModule:
        return self.inner.head(name)

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        raise ValueError("a bug")


def test_a_bug_fails_the_batch_but_says_which_requests_it_left_out(model: LayeredModel, device: DeviceThread) -> None:
    now = time.monotonic()
    with pytest.raises(ValueError, match="a bug") as raised:
        ModelRunner(Broken(model), device, top_k=2).run_sync(
            images(model, 4), [now + 60, now - 1, now + 60, now + 60], lambda i: i == 3
        )
    assert raised.value.left_out == (1, 3), "past its deadline, and gone: never sent to the model"  # type: ignore[attr-defined]


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


def test_out_of_memory_inside_a_torchscript_graph_is_split_too(model: LayeredModel, device: DeviceThread) -> None:
    # TorchScript re-raises the allocator's OutOfMemoryError as a plain RuntimeError: only its
    # text says what it was, and the split must still happen
    pressure: list[int] = []
    runner = ModelRunner(out_of_memory_in_graph(model, fail_at=3), device, top_k=3, on_pressure=pressure.append)
    batch = images(model, 4)
    answers = runner.run_sync(batch)
    expected = ModelRunner(model, device, top_k=3).run_sync(batch)
    assert [a.indices for a in answers] == [e.indices for e in expected]
    assert pressure == [4] and runner.failures == 0


def test_a_lost_device_is_a_failure_at_once_and_the_fallback_takes_over(
    model: LayeredModel, device: DeviceThread
) -> None:
    lost = DeviceLost(model)
    runner = ModelRunner(lost, device, top_k=3, fallback=lambda: model, fallback_after=2)
    with pytest.raises(DeviceUnavailable):
        runner.run_sync(images(model, 4))
    assert lost.sizes == [4], "a CUDA error is not split: the context is gone, not the memory"
    assert runner.failures == 1
    answers = runner.run_sync(images(model, 4))
    assert runner.degraded and runner.model is model and all(a is not None for a in answers)


def test_a_fallback_that_cannot_load_leaves_503s_and_is_not_tried_again(
    model: LayeredModel, device: DeviceThread
) -> None:
    loads: list[int] = []

    def broken() -> LayeredModel:
        loads.append(1)
        raise ModelLoadError("the CPU copy is corrupt")

    runner = ModelRunner(Faulty(model, always=True), device, top_k=3, fallback=broken, fallback_after=1)
    for _ in range(3):
        with pytest.raises(DeviceUnavailable):  # not the load's error: that would be a 500
            runner.run_sync(images(model, 1))
    assert loads == [1], "a failed fallback is not loaded again for every batch"
    assert not runner.degraded


def test_a_failed_attempt_lets_go_of_its_tensors_before_the_halves_run(
    model: LayeredModel, device: DeviceThread
) -> None:
    failed: list[weakref.ref[torch.Tensor]] = []
    alive_at_retry: list[bool] = []

    class Remembering(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            alive_at_retry.extend(ref() is not None for ref in failed)
            if len(images) >= self.fail_at:
                failed.append(weakref.ref(images))  # the stacked batch the failed attempt made
            return super().probabilities(images, head)

    ModelRunner(Remembering(model, fail_at=4), device, top_k=3).run_sync(images(model, 4))
    assert alive_at_retry == [False, False], "the failed batch was still referenced while its halves ran"


def test_the_requests_gone_during_a_failed_attempt_are_left_out_of_the_retries(
    model: LayeredModel, device: DeviceThread
) -> None:
    gone = [False] * 4
    deadlines = [time.monotonic() + 60] * 4

    class Slow(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            if len(images) >= self.fail_at:  # while the attempt fails, one expires, one's client goes
                deadlines[0] = time.monotonic() - 1
                gone[3] = True
            return super().probabilities(images, head)

    slow = Slow(model, fail_at=4)
    answers = ModelRunner(slow, device, top_k=2).run_sync(images(model, 4), deadlines, lambda i: gone[i])
    assert answers[0] is None and answers[3] is None and answers[1] is not None and answers[2] is not None
    assert slow.sizes == [4, 1, 1], "each retry computed only its live requests"


def test_device_faults_are_told_from_other_errors() -> None:
    assert device_fault(torch.cuda.OutOfMemoryError("CUDA out of memory.")) is Fault.MEMORY
    scripted = "The following operation failed in the TorchScript interpreter.\nCUDA out of memory. Tried to allocate"
    assert device_fault(RuntimeError(scripted)) is Fault.MEMORY
    assert device_fault(RuntimeError("CUDA error: unspecified launch failure")) is Fault.DEVICE
    with pytest.raises(RuntimeError) as host:  # the CPU allocator's, as torch raises it
        torch.empty(2**62, dtype=torch.uint8)
    assert device_fault(host.value) is Fault.MEMORY
    if hasattr(torch, "AcceleratorError"):
        assert device_fault(torch.AcceleratorError("device-side assert triggered")) is Fault.DEVICE
        # a failed allocation comes as AcceleratorError too, and leaves the context usable
        assert device_fault(torch.AcceleratorError("CUDA error: out of memory")) is Fault.MEMORY
    # cuBLAS and cuDNN failing to allocate: out of memory, the context usable; their other failures: the device's
    cublas = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    assert device_fault(RuntimeError(cublas)) is Fault.MEMORY
    assert device_fault(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")) is Fault.MEMORY
    assert device_fault(RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")) is Fault.DEVICE
    assert device_fault(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`")) is Fault.DEVICE
    assert device_fault(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED")) is None, "the call's, not the device's"
    assert device_fault(RuntimeError("CUBLAS_STATUS_INVALID_VALUE when calling `cublasSgemm`")) is None
    assert (
        fault_line(RuntimeError(f"The following operation failed in the TorchScript interpreter.\n{cublas}")) == cublas
    )
    assert device_fault(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert device_fault(ValueError("out of memory")) is None


def test_an_image_that_never_fits_fails_alone_and_the_others_are_answered(
    model: LayeredModel, device: DeviceThread
) -> None:
    batch = images(model, 4)
    batch[2] = batch[2] + 1.0  # unlike the others
    unfit = Unfit(model, lambda image: bool(torch.equal(image, batch[2])))
    runner = ModelRunner(unfit, device, top_k=3)
    answers = runner.run_sync(batch)
    expected = ModelRunner(model, device, top_k=3).run_sync(batch)
    assert isinstance(answers[2], DeviceUnavailable) and "one image" in str(answers[2])
    for i in (0, 1, 3):
        assert answers[i].indices == expected[i].indices
    assert unfit.sizes == [4, 2, 2, 1, 1]
    assert runner.failures == 1, "an image the device cannot hold is a device failure"


def test_a_device_lost_mid_batch_keeps_what_it_computed(model: LayeredModel, device: DeviceThread) -> None:
    # out of memory at 4, the first half computes, then the context is gone for the second
    lost = LostAfter(model, batches=1, fail_at=4)
    runner = ModelRunner(lost, device, top_k=3)
    answers = runner.run_sync(images(model, 4))
    assert [type(a).__name__ for a in answers] == ["TopK", "TopK", "DeviceUnavailable", "DeviceUnavailable"]
    assert lost.sizes == [4, 2, 2], "nothing more runs on a lost device: the second half is not split"
    assert runner.failures == 1


def test_a_bug_in_a_half_split_off_fails_that_half_and_keeps_the_answers_of_the_other(
    model: LayeredModel, device: DeviceThread
) -> None:
    class BuggyAfter(Faulty):  # out of memory at 4; the first half computes, the second hits a bug
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            if len(self.sizes) == 2:
                self.sizes.append(len(images))
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
            return super().probabilities(images, head)

    buggy = BuggyAfter(model, fail_at=4)
    runner = ModelRunner(buggy, device, top_k=3)
    answers = runner.run_sync(images(model, 4))
    assert [type(a).__name__ for a in answers] == ["TopK", "TopK", "BatchFailed", "BatchFailed"]
    assert buggy.sizes == [4, 2, 2]
    assert runner.failures == 0, "a bug is not the device failing"
    whole = BuggyAfter(model)
    whole.sizes = [0, 0]  # the bug at once, on the whole batch: it still fails as a whole
    with pytest.raises(RuntimeError, match="mat1"):
        ModelRunner(whole, device, top_k=3).run_sync(images(model, 2))


def test_a_bug_in_one_half_and_no_memory_in_the_other_answer_each_image_its_own_error(
    model: LayeredModel, device: DeviceThread
) -> None:
    class Mixed(Faulty):  # out of memory at 2; then a bug in the first half, no memory for the second
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            self.sizes.append(len(images))
            if len(self.sizes) == 2:
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    answers = ModelRunner(Mixed(model), device, top_k=3).run_sync(images(model, 2))
    assert [type(a).__name__ for a in answers] == ["BatchFailed", "DeviceUnavailable"], "neither is left out"
    assert isinstance(answers[0], BatchFailed) and answers[0].logged, "its traceback is logged once, by the runner"


def test_a_bug_in_the_fallback_keeps_what_the_device_computed(model: LayeredModel, device: DeviceThread) -> None:
    batch = images(model, 4)
    batch[3] = batch[3] + 1.0
    unfit = Unfit(model, lambda image: bool(torch.equal(image, batch[3])))

    class BuggyFallback(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            raise RuntimeError("a bug in the fallback")

    runner = ModelRunner(unfit, device, top_k=3, fallback=lambda: BuggyFallback(model), fallback_after=1)
    answers = runner.run_sync(batch)
    assert [type(a).__name__ for a in answers] == ["TopK", "TopK", "TopK", "BatchFailed"]


def test_the_fallback_computes_only_what_the_device_could_not(model: LayeredModel, device: DeviceThread) -> None:
    lost = LostAfter(model, batches=1, fail_at=4)
    computed: list[int] = []

    class Counting(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            computed.append(len(images))
            return super().probabilities(images, head)

    runner = ModelRunner(lost, device, top_k=3, fallback=lambda: Counting(model), fallback_after=1)  # type: ignore[arg-type,return-value]
    batch = images(model, 4)
    answers = runner.run_sync(batch)
    expected = ModelRunner(model, device, top_k=3).run_sync(batch)
    assert [a.indices for a in answers] == [e.indices for e in expected]
    assert computed == [2] and runner.degraded and runner.failures == 0


def test_batches_failing_at_once_on_two_threads_bring_one_fallback(model: LayeredModel, device: DeviceThread) -> None:
    both_failing = threading.Barrier(2, timeout=10)

    class Together(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            both_failing.wait()  # each thread's batch is on the device when the other's fails
            return super().probabilities(images, head)

    loads: list[int] = []

    def fallback() -> LayeredModel:
        loads.append(1)
        return model

    runner = ModelRunner(Together(model, always=True), device, top_k=3, fallback=fallback, fallback_after=1)
    answers: list[list[object]] = []
    threads = [threading.Thread(target=lambda: answers.append(runner.run_sync(images(model, 2)))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(answers) == 2 and all(a is not None and type(a).__name__ == "TopK" for batch in answers for a in batch)
    assert loads == [1], "the second failure waited, saw the fallback in place, and used it"
    assert runner.degraded and runner.failures == 0


def test_a_fallback_that_fails_too_is_not_replaced_by_another_copy(model: LayeredModel, device: DeviceThread) -> None:
    loads: list[int] = []

    def fallback() -> Faulty:
        loads.append(1)
        return Faulty(model, always=True)  # the CPU copy runs out of memory as well

    runner = ModelRunner(Faulty(model, always=True), device, top_k=3, fallback=fallback, fallback_after=1)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(DeviceUnavailable):
            runner.run_sync(images(model, 1))
    assert loads == [1] and runner.degraded, "one fallback, for good: no copy of a copy for every failure"


def _model_with_a_bad_head(root: Path) -> LayeredModel:
    torch.manual_seed(0)
    bundled = Manifest.read(DIGITS_DIR / "1")
    folder = write_version(
        root,
        name=MODEL_NAME,
        version="1",
        backbone=make_backbone(),
        heads={"classifier": nn.Linear(64, 9)},  # 9 outputs for 10 labels: its self-check fails
        input_spec=bundled.input,
        labels=LABELS,
        provenance=Provenance(source="tests"),
    )
    return LayeredModel.load(folder, Manifest.read(folder), torch.device("cpu"), torch.float32)


def test_a_remembered_failed_head_does_not_keep_every_batch_alive(tmp_path: Path, device: DeviceThread) -> None:
    # one error kept and raised again for every batch would gather each raise's frames in its
    # traceback, and with them each batch's images: every request's input kept for good
    model = _model_with_a_bad_head(tmp_path / "models")
    runner = ModelRunner(model, device, top_k=3)
    refs = []
    for _ in range(5):
        batch = list(model.dummy_batch(4))
        refs.append(weakref.ref(batch[0]))
        with pytest.raises(Unavailable):
            runner.run_sync(batch)
        del batch
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive == 0, f"{alive} of 5 failed batches' images are still referenced"


class Dropped:
    """An observer that records why the requests left out at the device went."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def on_batch(self, *args: object) -> None: ...

    def on_rejected(self, lane: Lane, reason: str) -> None: ...

    def on_dropped(self, lane: Lane, reason: str) -> None:
        self.reasons.append(reason)


@pytest.mark.parametrize("leaves", ["gone", "deadline"])
async def test_a_request_left_out_of_a_batch_the_device_then_fails_is_counted_and_marked(
    model: LayeredModel, device: DeviceThread, leaves: str
) -> None:
    observer = Dropped()
    runner = ModelRunner(Faulty(model, always=True), device, 3)
    traced = TracedRunner(runner, trace.NoOpTracer(), "m", "1", "float32", observer)
    jobs = [Job(image, Lane.NORMAL, f"r{i}", None) for i, image in enumerate(images(model, 2))]
    if leaves == "gone":
        jobs[0].gone = True  # its client went after the batch formed: left out at the device
    else:
        jobs[0].deadline = time.monotonic() - 1  # its deadline passed while the batch waited
    with pytest.raises(DeviceUnavailable) as raised:
        await traced(jobs)
    assert observer.reasons == ["cancelled" if leaves == "gone" else "deadline"], "counted once, as what it was"
    assert [job.left_out for job in jobs] == [True, False], "the service answers it as what happened to it"
    assert raised.value.batch_trace.size == 2  # type: ignore[attr-defined]


def test_a_batch_whose_requests_all_went_does_not_reset_the_failure_count(
    model: LayeredModel, device: DeviceThread
) -> None:
    loads: list[str] = []

    def fallback() -> LayeredModel:
        loads.append("cpu")
        return model

    runner = ModelRunner(Faulty(model, always=True), device, 3, fallback=fallback, fallback_after=2)
    batch = images(model, 2)
    with pytest.raises(DeviceUnavailable):
        runner.run_sync(batch)  # the device's first failure
    assert runner.run_sync(batch, [time.monotonic() - 1] * 2) == [None, None]  # never reached the device
    assert runner.failures == 1
    answers = runner.run_sync(batch)  # the second failure in a row: the fallback takes over and answers
    assert loads == ["cpu"] and all(answer is not None for answer in answers)


class LibraryStatus(Faulty):
    """Batches of ``fail_at`` or more fail with ``message``, as torch raises a library's status."""

    def __init__(self, inner: LayeredModel, message: str, fail_at: int = 1) -> None:
        super().__init__(inner, fail_at=fail_at)
        self.message = message

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        self.sizes.append(len(images))
        if len(images) >= self.fail_at:
            raise RuntimeError(self.message)
        return self.inner.probabilities(images, head)


def test_a_cudnn_9_allocation_failure_is_out_of_memory_and_splits_the_batch(
    model: LayeredModel, device: DeviceThread
) -> None:
    # cuDNN 9 has no ALLOC_FAILED: its failed workspace allocation is an "internal error" by name
    faulty = LibraryStatus(model, "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", fail_at=3)
    pressure: list[int] = []
    runner = ModelRunner(faulty, device, top_k=3, on_pressure=pressure.append)
    answers = runner.run_sync(images(model, 4))
    assert all(isinstance(answer, TopK) for answer in answers)
    assert faulty.sizes == [4, 2, 2] and pressure == [4] and runner.failures == 0


def test_a_cublas_status_about_the_call_is_a_bug_not_a_lost_device(model: LayeredModel, device: DeviceThread) -> None:
    # torch puts "CUDA error: " before every cuBLAS status: NOT_SUPPORTED is a shape or a dtype of ours
    status = "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmStridedBatchedEx(handle, opa, opb, ...)`"
    loads: list[str] = []

    def fallback() -> LayeredModel:
        loads.append("cpu")
        return model

    runner = ModelRunner(LibraryStatus(model, status), device, top_k=3, fallback=fallback, fallback_after=1)
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_SUPPORTED"):  # a 500, not a 503
        runner.run_sync(images(model, 4))
    assert runner.failures == 0 and loads == [] and not runner.degraded, "no device failure, no fallback"


def test_a_padded_batch_out_of_memory_lowers_the_ceiling_from_the_size_it_ran_at(
    model: LayeredModel, device: DeviceThread
) -> None:
    # padded up to 16, 10 images run as 16 rows and each half of 5 as 8: the device holds 4. The
    # ceiling is half the rows that failed (8, then 4), not half the images (5: batches of 5 padded
    # to 8, three rows of zeros, and a cap that doubles to 10, padded to 16 again)
    faulty = Faulty(dataclasses.replace(model, largest_batch=lambda: 16), fail_at=8)
    pressure: list[int] = []
    answers = ModelRunner(faulty, device, top_k=3, on_pressure=pressure.append).run_sync(images(model, 10))
    assert all(isinstance(answer, TopK) for answer in answers)
    assert faulty.sizes == [16, 8, 2, 4, 8, 2, 4]
    assert pressure == [16, 8, 8]


def test_a_head_the_device_has_no_memory_for_fails_its_batch_once_unsplit(
    device: DeviceThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    lazy = LayeredModel.load(DIGITS, Manifest.read(DIGITS), torch.device("cpu"), torch.float32)  # heads on first use
    real, loads = loader.load_layer, []

    def load_layer(folder: Path, manifest: Manifest, layer: Layer, *args: torch.device | torch.dtype) -> PreparedLayer:
        loads.append(layer.name)
        if len(loads) == 1:  # the first try: the device has no room for the head's weights
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (injected: the head)")
        return real(folder, manifest, layer, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "load_layer", load_layer)
    pressure: list[int] = []
    faults: list[Fault] = []
    runner = ModelRunner(lazy, device, top_k=3, on_pressure=pressure.append, on_fault=faults.append)
    with pytest.raises(DeviceUnavailable, match="out of memory for the model's head"):
        runner.run_sync(images(lazy, 8))
    assert len(loads) == 1, "split, each half loaded the head again (2N - 1 loads)"
    assert pressure == [], "no batch size is to blame"
    assert faults == [Fault.MEMORY] and runner.failures == 1, "one failure of the batch"
    answers = runner.run_sync(images(lazy, 8))  # memory is back: the next batch loads it, once
    assert all(isinstance(answer, TopK) for answer in answers)
    assert len(loads) == 2 and lazy.head_loads == 1 and runner.failures == 0


async def test_each_device_thread_takes_the_fallbacks_torch_threads_up_and_a_model_on_the_device_its_own(
    model: LayeredModel,
) -> None:
    """The torch threads a device thread computes with once the CPU fallback serves: the CPU's plan,
    taken up by each device thread at its next batch, not the GPU's one thread."""
    device = DeviceThread(workers=2)
    before = torch.get_num_threads()
    image = model.dummy_batch(1)[0]
    try:

        def as_on_a_gpu() -> int:
            torch.set_num_threads(1)
            return torch.get_num_threads()  # torch takes the count up in each thread at its first use

        assert await device.run_on_each(as_on_a_gpu) == [1, 1]
        runner = ModelRunner(
            DeviceLost(model), device, 3, fallback=lambda: model, fallback_after=1, intra_op=1, fallback_intra_op=3
        )
        (answer,) = await runner([image])
        assert runner.degraded and isinstance(answer, TopK), "the fallback took over and answered"
        assert sorted(await device.run_on_each(torch.get_num_threads)) == [1, 3], "set on the thread that fell back"
        await device.run_on_each(lambda: runner.run_sync([image]))
        assert await device.run_on_each(torch.get_num_threads) == [3, 3], "each took them up at its next batch"
        on_the_device = ModelRunner(model, device, 3, intra_op=1)  # another version, still on the GPU
        await device.run_on_each(lambda: on_the_device.run_sync([image]))
        assert await device.run_on_each(torch.get_num_threads) == [1, 1], "its batches run as the GPU's plan says"
    finally:
        device.close()
        torch.set_num_threads(before)  # torch's count for threads yet to start is process-wide


class Recorded(ModelRunner):
    """A model runner that records how each batch was asked of it."""

    def __init__(self, model: LayeredModel, device: DeviceThread) -> None:
        super().__init__(model, device, 3)
        self.asked: list[tuple[bool, bool]] = []

    async def __call__(self, images, deadlines=None, urgent=False, gone=None, ids=None, riders=False):  # type: ignore[no-untyped-def, override]
        self.asked.append((urgent, riders))
        return await super().__call__(images, deadlines, urgent=urgent, gone=gone, ids=ids, riders=riders)


async def test_an_urgent_batch_says_whether_it_carries_normal_requests(
    model: LayeredModel, device: DeviceThread
) -> None:
    runner = Recorded(model, device)
    traced = TracedRunner(runner, trace.NoOpTracer(), "m", "1", "float32")
    two = images(model, 2)
    for lanes in ((Lane.URGENT, Lane.URGENT), (Lane.URGENT, Lane.NORMAL), (Lane.NORMAL, Lane.NORMAL)):
        await traced([Job(image, lane, f"r{i}", None) for i, (image, lane) in enumerate(zip(two, lanes, strict=True))])
    # alone, an urgent batch has a core to itself where normal batches may wait; with riders it is theirs too
    assert runner.asked == [(True, False), (True, True), (False, False)]
