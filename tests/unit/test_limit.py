"""``ai-backend limit``: the synthetic photos, the CPU accounting, and a whole run on the digits model."""

from __future__ import annotations

import base64
import io
import json
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from app.bench.limit import cli, measure, photos
from app.bench.limit.cost import Cost, cpu_cost
from app.bench.limit.every_core import measure_every_core, measure_every_thread
from app.bench.limit.measure import DecodeCost, ForwardCost
from app.bench.limit.model import model_repository
from app.bench.limit.photos import synthetic_photo
from app.bench.limit.report import cores, limit_report
from app.inference import device
from app.inference.device import CpuLimit, cpu_cores
from tests.support import MODELS_DIR


def test_synthetic_photos_are_deterministic_640x480_jpegs_of_a_photos_size() -> None:
    first, again, other = synthetic_photo(0), synthetic_photo(0), synthetic_photo(1)
    assert first == again and first != other
    image = Image.open(io.BytesIO(first))
    assert (image.format, image.size, image.mode) == ("JPEG", (640, 480), "RGB")
    assert 30_000 < len(first) < 200_000


def test_images_are_written_then_listed_by_name(tmp_path: Path) -> None:
    written = photos.write_images(tmp_path, 3, seed=2)
    (tmp_path / "notes.txt").write_text("not an image")
    assert photos.image_files(tmp_path) == written == sorted(written)


def test_cpu_cost_is_cpu_per_call_over_rounds_with_a_warm_up_pass() -> None:
    ticks = iter(float(t) for t in range(10_000))
    calls: list[int] = []
    cost = cpu_cost(calls.append, items=3, seconds=3.0, rounds=3, clock=lambda: next(ticks))
    # every clock read advances one second: the warm-up visits each item once, then each round
    # runs until a second of "CPU" passed and at least every item once
    assert calls[:3] == [0, 1, 2]
    assert cost.calls == len(calls) - 3
    assert isinstance(cost, Cost) and 0 < cost.min_s <= cost.median_s


def test_the_limit_is_cores_over_decode_plus_the_best_forward() -> None:
    decode = DecodeCost(base64_ms=0.2, decode_ms=1.3, total_ms=1.5, total_min_ms=1.45)
    forward = [ForwardCost(1, 1, 6.0, 6.0, 10), ForwardCost(16, 1, 2.5, 2.6, 10), ForwardCost(32, 1, 2.7, 2.7, 10)]
    report = limit_report(decode, forward, [], CpuLimit(2.0, "affinity mask"))
    assert report["best_batch"] == 16
    assert report["cpu_ms_per_image"] == 4.0
    assert report["images_per_s"] == 500.0
    assert report["serve_batch"] == 16, "32 costs 8% more per image: past the 5% tolerance"
    forward[2] = ForwardCost(32, 1, 2.6, 2.6, 10)
    assert limit_report(decode, forward, [], CpuLimit(2.0, "affinity mask"))["serve_batch"] == 32, "within 4%"


@pytest.fixture
def no_export(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    exported: list[str] = []

    def fake_export(arch: str, root: Path, **_: object) -> Path:
        exported.append(arch)
        (root / arch / "1").mkdir(parents=True)
        return root / arch / "1"

    monkeypatch.setattr("app.inference.export.export_torchvision", fake_export)
    yield exported


def test_a_missing_model_is_exported_into_the_repository_and_a_temporary_one_removed(
    tmp_path: Path, no_export: list[str]
) -> None:
    with model_repository(tmp_path, "mobilenet_v3_small") as root:
        assert root == tmp_path
    assert no_export == ["mobilenet_v3_small"] and (tmp_path / "mobilenet_v3_small").is_dir()
    with model_repository(tmp_path, "mobilenet_v3_small"):
        pass
    assert no_export == ["mobilenet_v3_small"], "a model that is there is not exported again"
    with model_repository(None, "resnet18") as temporary:
        assert (temporary / "resnet18").is_dir()
    assert not temporary.exists()


def test_a_whole_run_on_the_digits_model_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "limit.json"
    argv = ["--repository", str(MODELS_DIR), "--model", "digits", "--count", "2", "--images-out", str(tmp_path)]
    argv += ["--batch-sizes", "1,4", "--seconds", "0.05", "--pipeline-seconds", "0.2"]
    argv += ["--every-core-seconds", "0.3", "--out", str(out)]
    torch_threads, switch = torch.get_num_threads(), sys.getswitchinterval()
    assert cli.main(argv) == 0
    assert torch.get_num_threads() == torch_threads, "the thread count is put back"
    report = json.loads(out.read_text())
    result = report["limit"]
    assert report["images"]["count"] == 2 and (report["images"]["width"], report["images"]["height"]) == (640, 480)
    assert [r["batch_size"] for r in result["forward_1_thread"]] == [1, 4]
    assert result["best_batch"] in (1, 4)
    per_image = result["decode"]["total_ms"] + result["forward_cpu_ms"]
    assert result["images_per_s"] == pytest.approx(result["cores"] * 1000 / per_image, rel=1e-3)
    assert report["pipeline"] and all(run["images_per_s"] > 0 for run in report["pipeline"])
    every = report["every_core"]  # one process per core, each decoding and running its own batches
    # whole processes, the CPUs rounded up (a quota of 1.5 runs two)
    assert every["processes"] == cpu_cores() == len(every["per_process"]) and every["images"] > 0
    assert every["batch_size"] == result["best_batch"] and result["every_core_images_per_s"] == every["images_per_s"]
    threads = report["every_thread"]  # the same in this process, a thread per core
    assert threads["threads"] == cpu_cores() == len(threads["per_thread"]) and threads["images"] > 0
    assert threads["batch_size"] == result["best_batch"] and threads["switch_interval_ms"] == 0.2
    assert result["every_thread_images_per_s"] == threads["images_per_s"]
    assert sys.getswitchinterval() == switch, "the switch interval is put back"
    text = capsys.readouterr().out
    assert "**limit:" in text and f"in one process ({cpu_cores()} threads sharing the GIL at a 0.2 ms" in text


def test_given_images_are_used_and_a_folder_without_jpegs_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "only.png").write_bytes(base64.b64decode("iVBORw0KGgo="))
    code = cli.main(["--repository", str(MODELS_DIR), "--model", "digits", "--images", str(tmp_path)])
    assert code == 1


@pytest.mark.parametrize(
    ("kind", "says"),
    [("not a JPEG", "is not an image Pillow can open"), ("truncated", "the service would refuse it")],
)
def test_an_image_in_the_folder_that_cannot_be_decoded_is_named(
    kind: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "cannot identify image file <_io.BytesIO object at 0x...>": which of the folder's
    files was not said. A truncated JPEG opens, then fails in the service's decode, named too."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "a_good.jpg").write_bytes(synthetic_photo(0))
    bad = images / "b_bad.jpg"
    bad.write_bytes(b"not a JPEG at all" if kind == "not a JPEG" else synthetic_photo(1)[:2000])
    argv = ["--repository", str(MODELS_DIR), "--model", "digits", "--images", str(images), "--seconds", "0.05"]
    argv += ["--pipeline-seconds", "0", "--every-core-seconds", "0", "--out", str(tmp_path / "limit.json")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"ai-backend limit: {bad}" in err and says in err and "BytesIO" not in err, err
    assert not (tmp_path / "limit.json").exists()


class _RecordingModel:
    """Stands in for a LayeredModel: records the batch size of every forward pass."""

    class manifest:  # noqa: N801 - mirrors LayeredModel.manifest
        labels = ["a", "b", "c"]

    def __init__(self) -> None:
        self.calls: list[int] = []

    def batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(images)

    def probabilities(self, batch: torch.Tensor) -> torch.Tensor:
        self.calls.append(batch.shape[0])
        return torch.softmax(torch.ones(batch.shape[0], 3), dim=1)


def test_forward_sizes_are_timed_in_interleaved_rounds_each_the_median_of_its_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _RecordingModel()
    timed: list[int] = []  # the size of each timed stretch, in order
    drift = iter([1.0, 9.0, 2.0] * 4)  # per stretch: CPU ms per call; the median of 1, 9, 2 is 2

    def fake_cost(fn: Callable[[int], object], items: int, seconds: float, rounds: int, clock: object) -> Cost:
        fn(0)
        timed.append(model.calls[-1])
        return Cost(next(drift) / 1000, 0.0, 1)

    monkeypatch.setattr(measure, "cpu_cost", fake_cost)
    sizes = (1, 2, 4, 8)
    results = measure.measure_forward(model, [torch.zeros(3, 4, 4, dtype=torch.uint8)], sizes, 1, 0.3, rounds=3)  # type: ignore[arg-type]
    rounds = [timed[i : i + len(sizes)] for i in range(0, len(timed), len(sizes))]
    assert len(rounds) == 3 and all(sorted(r) == list(sizes) for r in rounds), "every size once in every round"
    assert len({tuple(r) for r in rounds}) > 1, "the order changes between rounds"
    per_call = {size: sorted(v for t, v in zip(timed, [1.0, 9.0, 2.0] * 4, strict=True) if t == size) for size in sizes}
    assert [r.cpu_ms_per_image for r in results] == [round(per_call[s][1] / s, 4) for s in sizes]


@pytest.mark.parametrize(("cpu_max", "threads", "cpus"), [("200000 100000", 2, 2.0), ("150000 100000", 2, 1.5)])
def test_the_limit_counts_the_cpus_a_cgroup_quota_allows_fraction_and_all(
    cpu_max: str, threads: int, cpus: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # four CPUs in the affinity mask, a container limited to two (or 1.5) by its cgroup v2 quota
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    real_read_text = pathlib.Path.read_text

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        if str(self) == "/sys/fs/cgroup/cpu.max":
            return cpu_max + "\n"
        return real_read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    assert device.cpu_cores() == threads, "the service plans whole threads"
    # the limit is CPUs / CPU per image: counting four would double it and halve the ratio, and
    # counting 1.5 CPUs as 2 would add a third to it
    assert cores() == cpus
    decode = DecodeCost(base64_ms=0.2, decode_ms=1.3, total_ms=1.5, total_min_ms=1.45)
    report = limit_report(decode, [ForwardCost(16, 1, 2.5, 2.6, 10)], [], device.cpu_limit())
    assert report["cores"] == cpus and report["images_per_s"] == cpus * 250
    assert "cgroup v2 /sys/fs/cgroup/cpu.max" in report["cores_from"], "the report says where its CPUs came from"


@pytest.mark.parametrize("megabytes", ["-1", "2048", "4096"])
def test_limit_refuses_a_malloc_retain_that_glibc_cannot_take(
    megabytes: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """mallopt takes a C int: 4096 MiB << 20 wraps to 0 (trim at once, the opposite of retaining) and
    2048 to a negative; the service bounds server.malloc_retain_mb to 0..2047, the limit does not."""

    def ran(_: object) -> dict[str, object]:
        raise AssertionError(f"--malloc-retain-mb {megabytes} was accepted and the limit ran")

    monkeypatch.setattr(cli, "run", ran)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--malloc-retain-mb", megabytes, "--out", "/dev/null"])
    assert exit_.value.code == 2


def test_limit_on_a_folder_with_an_image_the_service_would_refuse_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A camera JPEG over server.max_image_bytes (1 MiB): the service answers 413; the limit
    ended in a PayloadTooLarge traceback instead of its one-line error and exit status 1."""
    import io

    import numpy as np
    from PIL import Image

    from tests.support import MODELS_DIR

    noise = np.random.default_rng(0).integers(0, 256, (1200, 1600, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=95)
    assert len(buffer.getvalue()) > 1 << 20
    (tmp_path / "big.jpg").write_bytes(buffer.getvalue())
    argv = ["--repository", str(MODELS_DIR), "--model", "digits", "--images", str(tmp_path), "--seconds", "0.05"]
    argv += ["--pipeline-seconds", "0", "--every-core-seconds", "0", "--out", str(tmp_path / "limit.json")]
    assert cli.main(argv) == 1
    assert "ai-backend limit:" in capsys.readouterr().err


def test_every_core_fails_promptly_when_one_of_its_processes_dies(tmp_path: Path) -> None:
    """A process that fails before the start line (here: no model where it looks) leaves the others
    at the barrier and the parent waiting seconds + 300 s, then a bare queue.Empty."""
    import threading
    import time

    outcome: list[BaseException | object] = []

    def every_core() -> None:
        try:
            outcome.append(measure_every_core(tmp_path, "digits", None, ["AAAA"], 1, 0.1))
        except BaseException as exc:  # noqa: BLE001 - what it raised is the point
            outcome.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=every_core, daemon=True)
    worker.start()
    worker.join(timeout=90)
    assert outcome, f"still waiting {time.monotonic() - started:.0f} s after its processes failed"
    assert isinstance(outcome[0], (LookupError, RuntimeError)), outcome[0]


class _ThreadedModel:
    """Stands in for a LayeredModel in ``measure_every_thread``: notes which thread ran each batch,
    the switch interval and torch's thread count it ran at, and how many ran at once; a batch of
    ``fail_on`` raises."""

    def __init__(self, spec: object, fail_on: int | None = None) -> None:
        self.manifest = type("Manifest", (), {"input": spec, "labels": ["a", "b", "c"]})()
        self.fail_on, self.lock, self.inside, self.most_inside = fail_on, threading.Lock(), 0, 0
        self.seen: list[tuple[str, float, int]] = []

    def batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(images)

    def probabilities(self, batch: torch.Tensor) -> torch.Tensor:
        name = threading.current_thread().name
        with self.lock:
            timed = any(seen == name for seen, _, _ in self.seen)  # past this thread's warm-up
            self.inside += timed
            self.most_inside = max(self.most_inside, self.inside)
            self.seen.append((name, sys.getswitchinterval(), torch.get_num_threads()))
        try:
            time.sleep(0.01)  # as the forward pass, without the GIL: the others run meanwhile
            if batch.shape[0] == self.fail_on:
                raise MemoryError("injected")
            return torch.softmax(torch.ones(batch.shape[0], 3), dim=1)
        finally:
            with self.lock:
                self.inside -= timed


def _digits_spec_and_image() -> tuple[object, list[str]]:
    from app.inference.manifest import Manifest

    manifest = Manifest.model_validate_json((MODELS_DIR / "digits" / "1" / "manifest.json").read_text())
    buffer = io.BytesIO()
    Image.new("RGB", (640, 480), (200, 30, 90)).save(buffer, format="JPEG")
    return manifest.input, [base64.b64encode(buffer.getvalue()).decode()]


def test_every_core_in_one_process_runs_a_thread_per_core_at_the_services_switch_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("app.bench.limit.every_core.cpu_cores", lambda: 3)
    spec, encoded = _digits_spec_and_image()
    model = _ThreadedModel(spec)
    switch, torch_threads = sys.getswitchinterval(), torch.get_num_threads()
    result = measure_every_thread(model, encoded, 2, 0.3, switch_interval_ms=0.2)  # type: ignore[arg-type]
    assert result.threads == 3 == len(result.per_thread) and all(rate > 0 for rate in result.per_thread)
    assert result.images == 2 * (len(model.seen) - 3), "every batch after each thread's warm-up is counted"
    assert result.images_per_s == pytest.approx(result.images / result.seconds, rel=0.01)
    assert result.seconds >= 0.3, "it timed at least the seconds asked"
    names = {name for name, _, _ in model.seen}
    assert len(names) == 3 and threading.current_thread().name not in names
    assert model.most_inside == 3, "the threads run their timed batches at once"
    assert {(round(interval * 1000, 6), threads) for _, interval, threads in model.seen} == {(0.2, 1)}
    assert (sys.getswitchinterval(), torch.get_num_threads()) == (switch, torch_threads), "both are put back"


def test_every_core_in_one_process_says_why_a_thread_failed_and_leaves_no_thread_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("app.bench.limit.every_core.cpu_cores", lambda: 2)
    spec, encoded = _digits_spec_and_image()
    before, switch = threading.active_count(), sys.getswitchinterval()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a thread of the every-core run failed: MemoryError: injected"):
        measure_every_thread(_ThreadedModel(spec, fail_on=4), encoded, 4, 0.2, switch_interval_ms=0.2)  # type: ignore[arg-type]
    assert time.monotonic() - started < 30, "not the start line's 300 s"
    assert threading.active_count() == before and sys.getswitchinterval() == switch


def canned_limit_report() -> dict[str, object]:
    decode = DecodeCost(base64_ms=0.2, decode_ms=1.3, total_ms=1.5, total_min_ms=1.45)
    return {
        "model": "digits",
        "version": "1",
        "images": {"count": 1, "width": 640, "height": 480, "mean_bytes": 70_000},
        "host": {"torch_default_threads": 2},
        "limit": limit_report(decode, [ForwardCost(16, 1, 2.5, 2.6, 10)], [], CpuLimit(1.5, "cgroup v1 quota")),
        "pipeline": [],
        "every_core": None,
    }


def test_limit_refuses_an_out_path_it_cannot_write_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a traceback after the whole run, the figures lost."""

    def ran(_: object) -> dict[str, object]:
        raise AssertionError("measured with an --out it cannot write")

    monkeypatch.setattr(cli, "run", ran)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--out", str(tmp_path)])  # a folder
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err


def test_limit_prints_its_summary_before_writing_and_a_failed_write_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "run", lambda args: canned_limit_report())
    monkeypatch.setattr(cli, "write_text", lambda path, text: "No space left on device")
    out = tmp_path / "limit.json"
    assert cli.main(["--out", str(out)]) == 1
    printed = capsys.readouterr()
    assert "**limit: 375.0 images/s** = 1.5 / 4.000 ms" in printed.out, printed.out
    assert "1.5 cores (cgroup v1 quota)" in printed.out, "the summary says which CPUs it counted"
    assert printed.err.strip() == f"ai-backend limit: could not write {out}: No space left on device"
