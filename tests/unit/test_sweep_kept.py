"""``ai-backend sweep`` keeps what it measured: a dummy batch too large for the host is that size's
out-of-memory, every size's results are on disk as it ends (a process the kernel kills keeps the
sizes before), and the memory column reads against one post-load baseline."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.bench.output import write_text
from app.bench.sweep import cli
from app.bench.sweep.knee import recommend
from app.bench.sweep.memory import ProcessMemory
from app.bench.sweep.report import markdown
from app.bench.sweep.timing import Limits, sweep
from tests.support import copy_repository
from tests.unit.test_sweep import FakeProbe, canned_report, curve


@pytest.fixture
def torch_threads() -> Iterable[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_dummy_batch_the_host_cannot_allocate_is_that_size_s_out_of_memory() -> None:
    """It was made outside the handled branch: the allocator's error ended the sweep in a traceback."""

    def make_batch(size: int) -> torch.Tensor:
        if size >= 4:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes")
        return torch.zeros(size, 1)

    results = sweep(lambda batch: batch, make_batch, [1, 2, 4, 8], FakeProbe(), Limits(1, 2, 1.0))
    assert [(r.batch_size, r.status) for r in results] == [(1, "ok"), (2, "ok"), (4, "oom")]
    assert results[-1].error is not None and "DefaultCPUAllocator" in results[-1].error


def test_each_size_s_results_are_written_as_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    """A size the kernel's OOM killer ends (it kills, it does not raise: a KeyboardInterrupt stands in)
    lost every size timed before it: the JSON was written only after the last."""
    real_sweep = cli.sweep

    def killed_at_4(forward: Any, make_batch: Callable[[int], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        def batch(size: int) -> torch.Tensor:
            if size == 4:
                raise KeyboardInterrupt
            return make_batch(size)

        return real_sweep(forward, batch, *args, **kwargs)

    monkeypatch.setattr(cli, "sweep", killed_at_4)
    repository = copy_repository(tmp_path)
    out_json = tmp_path / "out" / "sweep.json"
    argv = ["--repository", str(repository), "--model", "digits", "--device", "cpu", "--max-batch", "8"]
    argv += ["--warmup", "0", "--iterations", "2", "--seconds-per-size", "0.1", "--out-json", str(out_json)]
    with pytest.raises(KeyboardInterrupt):
        cli.main([*argv, "--out-png", str(tmp_path / "out" / "sweep.png")])
    report = json.loads(out_json.read_text())
    assert [(row["batch_size"], row["status"]) for row in report["sizes"]] == [(1, "ok"), (2, "ok")]
    assert report["complete"] is False and report["recommendation"]["knee"] in (1, 2)
    assert [p.name for p in out_json.parent.iterdir()] == ["sweep.json"], "no temporary file left beside it"


def test_a_write_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    assert write_text(path, "first\n") is None and write_text(path, "second\n") is None
    assert path.read_text() == "second\n" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_max_batch_past_what_a_host_holds_is_warned_of(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert cli.main(["--repository", str(tmp_path / "empty"), "--max-batch", "100000"]) == 1  # no model
    err = capsys.readouterr().err
    assert "--max-batch 100000 is over 4096" in err and "OOM killer" in err


def test_the_memory_column_reads_against_one_post_load_baseline(tmp_path: Path) -> None:
    """Each size's start held what the allocators kept from the size before, so "growth" at 2 read
    as the difference from 1 (often about 0), not what size 2 needs above the loaded model."""
    status, clear_refs = tmp_path / "status", tmp_path / "clear_refs"
    mib = 1024 * 1024

    def state(rss: int, hwm: int) -> None:
        status.write_text(f"VmHWM:\t{hwm * 1024} kB\nVmRSS:\t{rss * 1024} kB\n")

    probe = ProcessMemory(status, clear_refs)
    state(rss=100, hwm=100)  # after the load
    probe.start()
    state(rss=150, hwm=150)  # size 1 peaked at 150 MiB, and the allocator kept it
    first = probe.stop()
    probe.start()  # size 2 starts at 150 MiB
    state(rss=170, hwm=170)
    second = probe.stop()
    assert first["peak_above_baseline_bytes"] == 50 * mib
    assert second["peak_above_baseline_bytes"] == 70 * mib and second["baseline_rss_bytes"] == 100 * mib
    assert second["growth_bytes"] == 20 * mib, "the old figure, kept under its old name"
    assert "peak RSS above post-load baseline" in probe.description

    results = curve({1: 100, 2: 150})
    results = [type(r)(**{**r.__dict__, "memory": memory}) for r, memory in zip(results, (first, second), strict=True)]
    report = canned_report(results, recommend(results, 0.10))
    table = markdown(report)
    assert "| peak RSS above post-load baseline MiB | peak RSS MiB |" in table
    assert "| 70.0 | 170.0 |" in table


def test_a_curve_that_climbs_slowly_past_the_knee_says_where_it_comes_near_its_best() -> None:
    """About 5% a doubling after 4: the knee is 4, and 64 gives 22% more; the report said 4 only."""
    results = curve({1: 100, 2: 200, 4: 300, 8: 315, 16: 330, 32: 347, 64: 365})
    rec = recommend(results, 0.10)
    assert (rec.knee, rec.max_batch, rec.near_best_batch) == (4, 4, 32)
    table = markdown(canned_report(results, rec))
    assert "near the best: batch 32 reaches 95% of the best throughput measured (365.0 items/s)" in table
