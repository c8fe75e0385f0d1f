"""Images decoded by the device thread that runs their batch (``server.decode=batch``): the cheap
checks up front, the decode on the device thread, a bad image answered alone, a request gone
before its batch never decoded, and where ``auto`` decodes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import trace
from PIL import JpegImagePlugin, PngImagePlugin

from app.errors import BadRequest, BatchFailed, DeviceUnavailable, PayloadTooLarge
from app.inference import preprocess
from app.inference.device import DeviceThread, plan_threads
from app.inference.encoded import kind_of
from app.inference.jobs import Answer, reached_the_device
from app.inference.loader import LayeredModel
from app.inference.manifest import InputSpec, Manifest
from app.inference.postprocess import TopK
from app.inference.runner import ModelRunner
from app.settings import load_settings
from tests.faults import Faulty
from tests.support import b64, sample_png
from tests.unit.test_runner import DIGITS

LIMITS = preprocess.ImageLimits(max_bytes=64 * 1024, max_pixels=1_000_000)
CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def model() -> LayeredModel:
    loaded = LayeredModel.load(DIGITS, Manifest.read(DIGITS), CPU, torch.float32)
    loaded.load_all_heads()
    return loaded


@pytest.fixture
def device() -> DeviceThread:
    thread = DeviceThread("test-device")
    yield thread
    thread.close()


def encoded(model: LayeredModel, data: bytes) -> preprocess.Encoded:
    return preprocess.encoded_payload(b64(data), model.manifest.input, LIMITS)


class Counted(preprocess.Encoded):
    """An ``Encoded`` image that says which thread decoded it, and how often."""

    __slots__ = ("threads",)

    def __init__(self, data: bytes, spec: InputSpec, limits: preprocess.ImageLimits) -> None:
        super().__init__(data, spec, limits)
        self.threads: list[str] = []

    def decode(self) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        return super().decode()


def test_the_checks_up_front_refuse_what_is_no_image_and_keep_the_rest_encoded(model: LayeredModel) -> None:
    spec = model.manifest.input
    png = sample_png(3)
    kept = preprocess.encoded_payload(b64(png), spec, LIMITS)
    assert kept.data == png and kept.decode_s == 0.0, "nothing decoded yet"
    assert preprocess.encoded_payload(png, spec, LIMITS).data == png, "raw bytes are taken as they are"
    with pytest.raises(BadRequest) as refused:
        preprocess.encoded_payload("not base64!", spec, LIMITS)
    assert refused.value.code == "invalid_base64"
    with pytest.raises(BadRequest) as refused:
        preprocess.encoded_payload(b64(b"GIF89a" + bytes(100)), spec, LIMITS)
    assert refused.value.code == "unsupported_image"
    with pytest.raises(PayloadTooLarge) as refused:
        preprocess.encoded_payload(b"\x89PNG\r\n\x1a\n" + bytes(LIMITS.max_bytes), spec, LIMITS)
    assert refused.value.code == "image_too_large"
    # the decode gives what the pool's decode gives, and times itself
    assert torch.equal(kept.decode(), preprocess.decode_payload(b64(png), spec, LIMITS))
    assert kept.decode_s > 0


@given(st.binary(max_size=16))
def test_the_signature_check_takes_what_pillows_jpeg_and_png_plugins_take(prefix: bytes) -> None:
    """Never refuses up front what the pool's decode (Pillow, or the JPEG fast path) would
    have opened as a JPEG or PNG: they are told apart by the same prefixes."""
    assert (kind_of(prefix) is not None) >= (JpegImagePlugin._accept(prefix) or PngImagePlugin._accept(prefix))
    for head in (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"):
        assert kind_of(head + prefix) is not None


async def test_the_device_thread_decodes_its_batch_and_answers_as_the_decoded_images_would_be(
    model: LayeredModel, device: DeviceThread
) -> None:
    spec = model.manifest.input
    data = [sample_png(d) for d in range(4)]
    pending = [Counted(item, spec, LIMITS) for item in data]
    runner = ModelRunner(model, device, top_k=3)
    answers = await runner(pending)
    decoded = await runner([preprocess.decode(item, spec, LIMITS) for item in data])
    assert [a.indices for a in answers if isinstance(a, TopK)] == [d.indices for d in decoded if isinstance(d, TopK)]
    assert len(answers) == 4 and all(isinstance(a, TopK) for a in answers)
    assert [image.threads for image in pending] == [["test-device"]] * 4


def test_a_broken_image_is_answered_alone_and_the_rest_of_its_batch_runs(
    model: LayeredModel, device: DeviceThread
) -> None:
    truncated = sample_png(2)[:60]  # a PNG's signature and header, no image data: found only by decoding
    batch: list[torch.Tensor | preprocess.Encoded] = [
        encoded(model, sample_png(1)),
        encoded(model, truncated),
        encoded(model, sample_png(5)),
    ]
    answers = ModelRunner(model, device, top_k=2).run_sync(batch)
    assert isinstance(answers[0], TopK) and isinstance(answers[2], TopK)
    assert isinstance(answers[1], BadRequest) and answers[1].code == "undecodable_image"
    assert isinstance(batch[0], torch.Tensor), "decoded in place: a retry after an out-of-memory split reuses it"
    assert isinstance(batch[1], preprocess.Encoded)
    only_bad = ModelRunner(model, device, top_k=2).run_sync([encoded(model, truncated)])
    assert isinstance(only_bad[0], BadRequest), "a batch with nothing to compute answers its errors"


def test_a_bug_in_decoding_fails_that_image_alone_with_a_generic_error(
    model: LayeredModel, device: DeviceThread, caplog: pytest.LogCaptureFixture
) -> None:
    class Buggy(preprocess.Encoded):
        __slots__ = ()

        def decode(self) -> torch.Tensor:
            raise KeyError("a bug")

    spec = model.manifest.input
    answers = ModelRunner(model, device, top_k=2).run_sync(
        [Buggy(sample_png(1), spec, LIMITS), encoded(model, sample_png(2))]
    )
    assert isinstance(answers[0], BatchFailed) and answers[0].status == 500
    assert str(answers[0]) == "inference failed" and answers[0].logged
    assert isinstance(answers[1], TopK)
    assert "decoding an image of a batch failed" in caplog.text


def test_an_image_whose_request_went_or_expired_is_never_decoded(model: LayeredModel, device: DeviceThread) -> None:
    spec = model.manifest.input
    pending = [Counted(sample_png(d), spec, LIMITS) for d in range(3)]
    now = time.monotonic()
    answers = ModelRunner(model, device, top_k=2).run_sync(
        list(pending), [now + 60, now - 1, now + 60], gone=lambda i: i == 2
    )
    assert isinstance(answers[0], TopK) and answers[1] is None and answers[2] is None
    assert [len(image.threads) for image in pending] == [1, 0, 0]


def test_auto_decodes_in_the_batch_where_each_device_thread_has_one_core() -> None:
    two = plan_threads(CPU, 0, 0, 0, cores=2, decode_mode="auto")
    assert two.decode_in_batch and two.workers == 3 and two.intra_op == 1, "one device thread more than the cores"
    assert two.urgent == 1
    assert plan_threads(CPU, 0, 0, 0, cores=3, decode_mode="auto").workers == 4
    pool = plan_threads(CPU, 0, 0, 0, cores=2, decode_mode="pool")
    assert not pool.decode_in_batch and pool.workers == 2
    eight = plan_threads(CPU, 0, 0, 0, cores=8, decode_mode="auto")
    assert not eight.decode_in_batch and eight.intra_op == 4, "several torch threads a batch: the pool decodes"
    assert plan_threads(CPU, 2, 0, 0, cores=2, decode_mode="auto") == plan_threads(CPU, 2, 0, 0, 2, None, "batch")
    assert plan_threads(CPU, 2, 0, 0, cores=2, decode_mode="auto").workers == 2, "a set worker count stays"
    assert plan_threads(CPU, 0, 0, 0, cores=1, decode_mode="auto").workers == 1
    assert not plan_threads(GPU, 0, 0, 0, cores=16, decode_mode="auto").decode_in_batch, "a GPU is fed by the pool"
    assert plan_threads(GPU, 0, 0, 0, cores=16, decode_mode="batch").decode_in_batch
    assert plan_threads(CPU, 0, 0, 0, cores=2).decode_in_batch is False, "pool unless asked"


def test_the_settings_default_decodes_by_auto() -> None:
    assert load_settings().server.decode == "auto"
    with pytest.raises(Exception, match="decode"):
        load_settings(server={"decode": "gpu"})


def test_a_request_that_goes_while_the_images_before_it_decode_is_not_decoded(
    model: LayeredModel, device: DeviceThread
) -> None:
    spec = model.manifest.input
    went: set[int] = set()

    class Slow(Counted):
        """Its client goes while it decodes: the request of the last image."""

        __slots__ = ()

        def decode(self) -> torch.Tensor:
            went.add(2)
            return super().decode()

    pending = [
        Counted(sample_png(0), spec, LIMITS),
        Slow(sample_png(1), spec, LIMITS),
        Counted(sample_png(2), spec, LIMITS),
    ]
    answers = ModelRunner(model, device, top_k=2).run_sync(list(pending), gone=lambda i: i in went)
    assert isinstance(answers[0], TopK) and isinstance(answers[1], TopK) and answers[2] is None
    assert [len(image.threads) for image in pending] == [1, 1, 0]


def test_a_whole_batch_failure_carries_the_errors_of_the_images_that_did_not_decode(
    model: LayeredModel, device: DeviceThread
) -> None:
    broken = sample_png(2)[:60]
    runner = ModelRunner(Faulty(model, always=True), device, top_k=2)
    with pytest.raises(DeviceUnavailable) as failed:
        runner.run_sync([encoded(model, sample_png(1)), encoded(model, broken)])
    assert failed.value.left_out == ()  # type: ignore[attr-defined]
    (refused,) = failed.value.refused.items()  # type: ignore[attr-defined]
    assert refused[0] == 1 and isinstance(refused[1], BadRequest) and refused[1].code == "undecodable_image"
    assert runner.failures == 1
    now = time.monotonic()  # one left out (expired), one refused: nothing reaches the device, nothing fails
    answers = runner.run_sync([encoded(model, sample_png(1)), encoded(model, broken)], [now - 1, now + 60])
    assert answers[0] is None and isinstance(answers[1], BadRequest) and runner.failures == 1
    three = [encoded(model, sample_png(1)), encoded(model, broken), encoded(model, sample_png(3))]
    with pytest.raises(DeviceUnavailable) as failed:  # one left out, one refused, one failed by the device
        runner.run_sync(three, [now - 1, now + 60, now + 60])
    assert failed.value.left_out == (0,) and set(failed.value.refused) == {1}  # type: ignore[attr-defined]


def test_only_what_reached_the_device_counts_as_computed() -> None:
    span = trace.INVALID_SPAN_CONTEXT
    assert reached_the_device(Answer(TopK((0.9,), (1,)), span, 0, 0))
    assert reached_the_device(Answer(DeviceUnavailable("failed"), span, 0, 0)), "the device took it, and failed"
    assert not reached_the_device(Answer(BadRequest("broken", code="undecodable_image"), span, 0, 0))
    assert not reached_the_device(Answer(None, span, 0, 0))


def test_the_normal_threads_are_niced_less_where_they_decode() -> None:
    """All of an image's work runs on them then: at nice 10 the event loop's refusals took so much
    of the cores at twice the load that fewer requests were answered in time."""
    assert plan_threads(CPU, 0, 0, 0, cores=2, decode_mode="auto").normal_nice == 2
    assert plan_threads(CPU, 0, 0, 0, cores=2, decode_mode="pool").normal_nice == 10
    assert plan_threads(CPU, 0, 0, 0, cores=8, decode_mode="auto").normal_nice == 10
    assert plan_threads(CPU, 0, 0, 0, cores=2, decode_mode="auto", normal_nice=7).normal_nice == 7, "as set"
    assert plan_threads(GPU, 0, 0, 0, cores=16, decode_mode="auto").normal_nice == 10
    assert load_settings().model.normal_nice is None, "config/default.toml leaves it to the service"


async def test_a_normal_batch_waits_for_the_urgent_batch_running_before_it_decodes(model: LayeredModel) -> None:
    """Where device threads outnumber the cores, a normal batch gives an urgent one the core first."""
    device = DeviceThread("pausing", workers=1, urgent_workers=1, urgent_pause_s=10.0, pausable=1)
    started, gate = threading.Event(), threading.Event()
    try:
        runner = ModelRunner(model, device, top_k=2)
        urgent = [Counted(sample_png(1), model.manifest.input, LIMITS)]

        def first(i: int) -> bool:  # read by the urgent batch as it decodes: held there
            started.set()
            return not gate.wait(10)

        held = asyncio.ensure_future(runner(urgent, urgent=True, gone=first))
        assert await asyncio.to_thread(started.wait, 10)
        pending = [Counted(sample_png(3), model.manifest.input, LIMITS)]
        batch = asyncio.ensure_future(runner(pending))
        await asyncio.sleep(0.05)
        assert not batch.done() and pending[0].threads == [], "nothing decoded while the urgent batch runs"
        gate.set()
        answers = await batch
        assert (await held)[0] is not None and isinstance(answers[0], TopK) and pending[0].threads == ["pausing"]
        # an urgent batch carrying normal requests (riders) is theirs too: the normal batch does not wait
        started.clear()
        gate.clear()
        held = asyncio.ensure_future(runner(urgent, urgent=True, gone=first, riders=True))
        assert await asyncio.to_thread(started.wait, 10)
        normal = runner([Counted(sample_png(4), model.manifest.input, LIMITS)])
        assert isinstance((await asyncio.wait_for(normal, 5))[0], TopK), "it would wait 10 s for the urgent batch"
        gate.set()
        await held
    finally:
        gate.set()
        device.close()
