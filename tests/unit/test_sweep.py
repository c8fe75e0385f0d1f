"""``ai-backend sweep``: the knee and recommendation on hand-made curves, the schedule, the
percentile, the timing loop on a fake clock, OOM handling, and one real run on the digits model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from PIL import Image

from app.bench.chart import nice_ticks
from app.bench.sweep import cli
from app.bench.sweep.knee import Recommendation, find_knee, recommend
from app.bench.sweep.memory import ProcessMemory
from app.bench.sweep.report import build_report, markdown
from app.bench.sweep.timing import Forward, Limits, SizeResult, batch_sizes, percentile, sweep
from app.inference.device import cpu_cores, plan_threads
from tests.support import copy_repository


def curve(
    points: dict[int, float], latency_ms: dict[int, float] | None = None, oom_at: int | None = None
) -> list[SizeResult]:
    """Results with the given throughput per size; latency defaults to size / throughput."""
    results = [
        SizeResult(size, median_ms=(latency_ms or {}).get(size, size / tp * 1000), throughput=tp)
        for size, tp in sorted(points.items())
    ]
    if oom_at is not None:
        results.append(SizeResult(oom_at, "oom", error="CUDA out of memory"))
    return results


# ---- schedule and percentile -------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_batch", "expected"),
    [(1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (64, [1, 2, 4, 8, 16, 32, 64]), (100, [1, 2, 4, 8, 16, 32, 64])],
)
def test_the_schedule_doubles_from_one_up_to_the_max(max_batch: int, expected: list[int]) -> None:
    assert batch_sizes(max_batch) == expected


def test_the_schedule_refuses_a_max_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        batch_sizes(0)


def test_percentile_interpolates_between_ranks() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_nice_ticks_start_at_zero_cover_the_maximum_and_use_round_steps() -> None:
    assert nice_ticks(100) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(0.6) == pytest.approx([0, 0.2, 0.4, 0.6])
    ticks = nice_ticks(105_447.8)
    assert ticks[0] == 0 and ticks[-1] >= 105_447.8 and len(ticks) <= 7
    assert nice_ticks(0) == [0.0, 1.0]


# ---- knee and recommendation -------------------------------------------------------------


def test_a_flat_curve_has_its_knee_at_one() -> None:
    assert find_knee(curve({1: 100, 2: 102, 4: 101, 8: 103}), 0.10) == (1, True)


def test_a_falling_curve_has_its_knee_at_one() -> None:
    assert find_knee(curve({1: 100, 2: 90, 4: 70}), 0.10) == (1, True)


def test_a_curve_that_keeps_rising_has_its_knee_at_the_largest_size_not_reached() -> None:
    rec = recommend(curve({1: 100, 2: 200, 4: 390, 8: 700}), 0.10)
    assert (rec.knee, rec.knee_reached, rec.max_batch) == (8, False, 8)
    assert "still gained" in rec.reason


def test_a_saturating_curve_has_its_knee_where_doubling_stops_paying() -> None:
    results = curve({1: 100, 2: 190, 4: 350, 8: 370, 16: 380, 32: 381})
    rec = recommend(results, 0.10)
    assert (rec.knee, rec.knee_reached, rec.max_batch) == (4, True, 4)
    assert "beyond batch 4" in rec.reason


def test_the_gain_threshold_decides_the_knee() -> None:
    results = curve({1: 100, 2: 190, 4: 350, 8: 400})  # 4 -> 8 gains 14%
    assert find_knee(results, 0.10) == (8, False)
    assert find_knee(results, 0.20) == (4, True)


def test_a_plateau_followed_by_a_real_jump_is_not_the_knee() -> None:
    results = curve({1: 100, 2: 104, 4: 106, 8: 160, 16: 165})
    assert find_knee(results, 0.10) == (8, True)


def test_a_rebound_from_a_dip_that_stays_under_the_best_is_not_a_gain() -> None:
    # the README's mobilenet_v3_small curve, with batch 64 10% over 32 (noise) yet under 16
    results = curve({1: 188, 4: 262, 8: 391, 16: 405, 32: 337, 64: 375})
    rec = recommend(results, 0.10)
    assert (rec.knee, rec.knee_reached, rec.max_batch) == (8, True, 8)


def test_sizes_after_an_out_of_memory_do_not_count() -> None:
    rec = recommend(curve({1: 100, 2: 190, 4: 350}, oom_at=8), 0.10)
    assert (rec.knee, rec.knee_reached, rec.max_batch) == (4, False, 4)
    assert "batch 8 ran out of memory" in rec.reason


def test_a_single_size_is_its_own_knee() -> None:
    rec = recommend(curve({1: 100}, oom_at=2), 0.10)
    assert (rec.knee, rec.knee_reached, rec.max_batch) == (1, False, 1)
    assert rec.reason == "only batch 1 was measured (batch 2 ran out of memory)"


def test_an_out_of_memory_at_batch_one_recommends_nothing() -> None:
    rec = recommend(curve({}, oom_at=1), 0.10)
    assert (rec.knee, rec.max_batch) == (None, None)
    assert "out of memory at batch 1" in rec.reason
    assert recommend([], 0.10).knee is None


def test_the_latency_budget_caps_the_recommendation_below_the_knee() -> None:
    latency = {1: 2.0, 2: 3.0, 4: 5.0, 8: 9.0, 16: 17.0}
    results = curve({1: 500, 2: 660, 4: 800, 8: 890, 16: 940}, latency)  # knee at 8
    assert recommend(results, 0.10, latency_budget_ms=100).max_batch == 8
    capped = recommend(results, 0.10, latency_budget_ms=6.0)
    assert (capped.knee, capped.max_batch) == (8, 4)
    assert "capped to 4 by the 6 ms latency budget" in capped.reason
    assert recommend(results, 0.10, latency_budget_ms=9.0).max_batch == 8  # within means <=


def test_a_budget_that_even_batch_one_misses_recommends_nothing() -> None:
    rec = recommend(curve({1: 100, 2: 190}, {1: 10.0, 2: 10.5}), 0.10, latency_budget_ms=5)
    assert (rec.knee, rec.max_batch) == (2, None)
    assert "within 5 ms" in rec.reason


# ---- the timing loop, on a fake clock ------------------------------------------------------


class FakeClock:
    """Time moves only when the fake model runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeProbe:
    kind = "fake"
    description = "fake"

    def __init__(self) -> None:
        self.starts = 0

    def start(self) -> None:
        self.starts += 1

    def stop(self) -> dict[str, int]:
        return {"growth_bytes": 0}


def fake_model(clock: FakeClock, ms_per_item: float, oom_from: int | None = None) -> tuple[Forward, list[int]]:
    calls: list[int] = []

    def forward(batch: torch.Tensor) -> object:
        size = batch.shape[0]
        calls.append(size)
        if oom_from is not None and size >= oom_from:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        clock.now += 0.001 + size * ms_per_item / 1000
        return batch

    return forward, calls


def run(
    sizes: Iterable[int], limits: Limits, ms_per_item: float = 1.0, oom_from: int | None = None
) -> tuple[list[SizeResult], list[int]]:
    clock = FakeClock()
    forward, calls = fake_model(clock, ms_per_item, oom_from)
    results = sweep(forward, lambda n: torch.zeros(n, 1), list(sizes), FakeProbe(), limits, clock=clock)
    return results, calls


def test_each_size_gets_warm_up_then_its_timed_passes() -> None:
    results, calls = run([1, 2], Limits(warmup=2, iterations=5, seconds_per_size=100))
    assert calls == [1] * 7 + [2] * 7
    assert [r.iterations for r in results] == [5, 5]
    assert results[0].median_ms == pytest.approx(2.0)
    assert results[1].throughput == pytest.approx(2 / 0.003)


def test_the_time_budget_bounds_the_passes_but_never_below_one() -> None:
    results, _ = run([1, 64], Limits(warmup=1, iterations=1000, seconds_per_size=0.01), ms_per_item=1.0)
    assert results[0].iterations == 5  # 2 ms a pass, 10 ms budget
    assert results[1].iterations == 1  # one pass already overruns the budget


def test_an_out_of_memory_is_recorded_and_ends_the_sweep() -> None:
    results, calls = run([1, 2, 4, 8, 16], Limits(warmup=1, iterations=3, seconds_per_size=1), oom_from=4)
    assert [(r.batch_size, r.status) for r in results] == [(1, "ok"), (2, "ok"), (4, "oom")]
    assert results[-1].error == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert 8 not in calls and 16 not in calls


def test_process_memory_reads_rss_and_peak(tmp_path: Path) -> None:
    status, clear_refs = tmp_path / "status", tmp_path / "clear_refs"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    probe = ProcessMemory(status, clear_refs)
    probe.start()
    status.write_text("VmHWM:\t  4096 kB\nVmRSS:\t  1536 kB\n")
    assert probe.stop() == {
        "rss_before_bytes": 1024 * 1024,
        "peak_rss_bytes": 4096 * 1024,
        "rss_after_bytes": 1536 * 1024,
        "growth_bytes": 3072 * 1024,
        "baseline_rss_bytes": 1024 * 1024,
        "peak_above_baseline_bytes": 3072 * 1024,
    }
    assert clear_refs.read_text() == "5"
    probe = ProcessMemory(status, tmp_path / "missing" / "clear_refs")
    probe.start()
    assert not probe.peak_resets and "could not be reset" in probe.description


# ---- a real run on the bundled model -------------------------------------------------------


@pytest.fixture
def torch_threads() -> Iterable[None]:
    """The sweep sets torch's thread count for its process: the test process gets its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_real_sweep_of_the_digits_model_writes_table_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], torch_threads: None
) -> None:
    repository = copy_repository(tmp_path)
    out_json, out_png = tmp_path / "out" / "sweep.json", tmp_path / "out" / "sweep.png"
    code = cli.main(
        [
            "--repository", str(repository), "--model", "digits", "--device", "cpu",
            "--max-batch", "8", "--warmup", "1", "--iterations", "5", "--seconds-per-size", "0.2",
            "--latency-budget-ms", "10000", "--out-json", str(out_json), "--out-png", str(out_png),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out_json.read_text())
    assert (report["model"], report["version"], report["device"], report["dtype"]) == ("digits", "1", "cpu", "float32")
    assert report["memory"]["kind"] == "process-rss"
    assert [row["batch_size"] for row in report["sizes"]] == [1, 2, 4, 8]
    for row in report["sizes"]:
        assert row["status"] == "ok"
        assert 1 <= row["iterations"] <= 5
        assert 0 < row["min_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["throughput"] == pytest.approx(row["batch_size"] / row["median_ms"] * 1000)
        assert set(row["memory"]) == {
            "rss_before_bytes", "peak_rss_bytes", "rss_after_bytes", "growth_bytes",
            "baseline_rss_bytes", "peak_above_baseline_bytes",
        }  # fmt: skip
    rec = report["recommendation"]
    assert rec["knee"] in (1, 2, 4, 8) and rec["max_batch"] == rec["knee"] and rec["reason"]
    assert report["settings"]["max_batch"] == 8 and report["settings"]["latency_budget_ms"] == 10000
    assert report["complete"] is True, "every size ran: the last write is the whole report"
    # timed with the threads each of the service's batches runs with, not torch's one per core
    service_threads = plan_threads(torch.device("cpu"), 0, 0, 0, cpu_cores()).intra_op
    assert report["host"]["torch_threads"] == service_threads

    with Image.open(out_png) as image:
        image.verify()
    with Image.open(out_png) as image:
        assert image.format == "PNG"
        assert image.size == (report["plot"]["width"], report["plot"]["height"])

    table = capsys.readouterr().out
    columns = "| batch | iters | median ms | p90 ms | items/s | peak RSS above post-load baseline MiB | peak RSS MiB |"
    assert columns in table
    assert f"recommended max batch: {rec['max_batch']}" in table


@pytest.mark.parametrize("gain", ["0", "1", "10"])
def test_a_knee_gain_that_is_not_a_share_is_refused(gain: str, capsys: pytest.CaptureFixture[str]) -> None:
    # 10 meant as 10%: every doubling would have to gain 1000%, and the knee was always 1
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--knee-gain", gain])
    assert exit_.value.code == 2 and "--knee-gain" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "0", "-5"])
def test_a_latency_budget_that_is_not_a_finite_positive_number_is_refused_before_timing(
    budget: str, tmp_path: Path, no_model: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """nan and inf passed the check: the sweep timed every size, then crashed drawing the plot
    and left a report with NaN (not JSON) in it."""
    out = ["--out-json", str(tmp_path / "s.json"), "--out-png", str(tmp_path / "s.png")]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--model", "m", f"--latency-budget-ms={budget}", *out])
    assert exit_.value.code == 2 and "--latency-budget-ms" in capsys.readouterr().err
    assert no_model == [] and not (tmp_path / "s.json").exists()


def test_an_unknown_model_fails_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], torch_threads: None
) -> None:
    repository = copy_repository(tmp_path)
    assert cli.main(["--repository", str(repository), "--model", "nope", "--out-json", str(tmp_path / "x.json")]) == 1
    assert "model 'nope' is not in" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_no_model_named_in_a_repository_of_several_asks_for_one_and_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], torch_threads: None
) -> None:
    """It said "model None is not in models (it holds: digits, twin)"."""
    import shutil

    repository = copy_repository(tmp_path)
    shutil.copytree(repository / "digits", repository / "twin")
    assert cli.main(["--repository", str(repository), "--out-json", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert f"--model is needed: {repository} holds several models (digits, twin)" in err and "None" not in err
    (tmp_path / "empty").mkdir()
    assert cli.main(["--repository", str(tmp_path / "empty"), "--out-json", str(tmp_path / "x.json")]) == 1
    assert f"{tmp_path / 'empty'} holds no model" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_cpu_out_of_memory_is_recorded_and_ends_the_sweep_as_a_cuda_one_is() -> None:
    """On the CPU, torch's allocator refuses a batch too large for the machine with a RuntimeError,
    not torch.cuda.OutOfMemoryError: the sweep crashed and wrote nothing of the sizes it had timed."""
    import torch

    class Probe:
        kind, description = "fake", "fake"

        def start(self) -> None:
            pass

        def stop(self) -> dict[str, int]:
            return {}

    def forward(batch: torch.Tensor) -> object:
        if batch.shape[0] >= 4:  # activations for this batch: more than the machine has
            return torch.empty(batch.shape[0] << 48, dtype=torch.uint8)
        return batch

    results = sweep(forward, lambda n: torch.zeros(n, 1), [1, 2, 4, 8], Probe(), Limits(1, 2, 1.0))
    assert [(r.batch_size, r.status) for r in results] == [(1, "ok"), (2, "ok"), (4, "oom")]


# ---- what the table, the plot and the command say -------------------------------------------


def canned_report(results: list[SizeResult], rec: Recommendation, png: Path = Path("x.png")) -> dict[str, object]:
    meta = {
        "model": "m",
        "version": "1",
        "device": "cpu",
        "dtype": "float32",
        "torch": "2",
        "host": {"torch_threads": 1},
        "settings": {"latency_budget_ms": None},
        "memory": {"kind": "process-rss", "description": "rss"},
        "plot": {"path": str(png), "width": 960, "height": 600},
    }
    return build_report(meta, results, rec)


def test_a_curve_still_rising_at_the_largest_size_is_not_said_to_have_a_knee_there() -> None:
    rising = curve({1: 100, 2: 200, 4: 400, 8: 800})
    table = markdown(canned_report(rising, recommend(rising, 0.10)))
    assert "| no knee up to here, recommended |" in table and "| knee" not in table
    assert "no knee up to batch 8; recommended max batch: 8" in table
    saturating = curve({1: 100, 2: 190, 4: 350, 8: 360})
    table = markdown(canned_report(saturating, recommend(saturating, 0.10)))
    assert "| knee, recommended |" in table and "knee: batch 4; recommended max batch: 4" in table


def test_the_plot_labels_a_knee_only_where_one_was_reached() -> None:
    from app.bench.chart import knee_marks, knee_text

    def rec(knee: int | None, reached: bool, chosen: int | None) -> dict[str, object]:
        return {"knee": knee, "knee_reached": reached, "max_batch": chosen}

    assert [label for _, label, _ in knee_marks(rec(4, True, 4))] == ["knee = recommended 4"]
    assert [label for _, label, _ in knee_marks(rec(16, False, 16))] == ["no knee up to 16; recommended 16"]
    assert [label for _, label, _ in knee_marks(rec(16, False, 4))] == ["no knee up to 16", "recommended 4"]
    assert [label for _, label, _ in knee_marks(rec(8, True, None))] == ["knee 8"]
    assert knee_marks(rec(None, False, None)) == []
    assert (knee_text(rec(4, True, 4)), knee_text(rec(16, False, 16))) == ("knee: batch 4", "no knee up to batch 16")


def test_a_latency_budget_far_above_the_curve_does_not_flatten_it(tmp_path: Path) -> None:
    """A budget of 5 s against medians under a millisecond set the right axis to 5,000 ms, and
    the medians were drawn as a flat line on its floor: such a budget is said in words instead."""
    from app.bench.chart import _Chart, plot

    results = curve({1: 2000, 2: 3000, 4: 3500}, latency_ms={1: 0.5, 2: 0.7, 4: 1.1})
    report = canned_report(results, recommend(results, 0.10, 5000.0))
    report["settings"] = {"latency_budget_ms": 5000.0}
    chart = _Chart(report, (960, 600))
    assert chart.ms_ticks[-1] < 2, chart.ms_ticks
    assert not chart.budget_on_axis
    report["settings"] = {"latency_budget_ms": 1.4}  # within reach of the curve: drawn on the axis
    chart = _Chart(report, (960, 600))
    assert chart.ms_ticks[-1] >= 1.4 and chart.budget_on_axis
    for budget in (5000.0, 1.4, None):
        report["settings"] = {"latency_budget_ms": budget}
        plot(report, tmp_path / "plot.png")
        with Image.open(tmp_path / "plot.png") as image:
            image.verify()


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch, torch_threads: None) -> list[str]:
    """The sweep without a model: ``_load`` loads nothing and ``_run`` returns a still-rising curve."""
    ran: list[str] = []

    def run(args: object, model: object, load_s: float) -> dict[str, object]:
        ran.append("run")
        results = curve({1: 100, 2: 200})
        return canned_report(results, recommend(results, 0.10))

    monkeypatch.setattr(cli, "_load", lambda args: (None, 0.0))
    monkeypatch.setattr(cli, "_run", run)
    return ran


def test_an_output_path_that_cannot_be_written_is_refused_before_the_sizes_are_timed(
    tmp_path: Path, no_model: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a traceback after every size had been timed, and the results were lost."""
    writable = {"--out-json": str(tmp_path / "s.json"), "--out-png": str(tmp_path / "s.png")}
    for flag in writable:
        paths = writable | {flag: str(tmp_path)}  # a folder
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--model", "m", *(part for pair in paths.items() for part in pair)])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err
    assert no_model == [], "nothing was measured"


def test_a_report_that_cannot_be_written_is_printed_first_then_one_line(
    tmp_path: Path, no_model: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "write_text", lambda path, text: "No space left on device")
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    assert cli.main(["--model", "m", "--out-json", str(out_json), "--out-png", str(out_png)]) == 1
    printed = capsys.readouterr()
    assert "| batch | iters |" in printed.out, "the table is printed before the files are written"
    assert printed.err.strip() == f"ai-backend sweep: could not write {out_json}: No space left on device"
