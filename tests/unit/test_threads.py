"""How many batches run at once on a device, and how many torch threads each gets."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from app.inference.device import Threads, plan_threads

CPU, GPU = torch.device("cpu"), torch.device("cuda:0")


def test_a_gpu_gets_one_worker_and_keeps_torch_s_threads() -> None:
    assert plan_threads(GPU, 0, 0, 0, cores=16) == Threads(1, 0, 8, 0)
    assert plan_threads(GPU, 3, 4, 2, cores=16) == Threads(3, 4, 2), "explicit settings win"


def test_a_cpu_of_two_cores_or_more_gets_an_urgent_thread_unless_told_otherwise() -> None:
    assert plan_threads(CPU, 0, 0, 0, cores=2).urgent == 1
    assert plan_threads(CPU, 0, 0, 0, cores=1).urgent == 0
    assert plan_threads(GPU, 0, 0, 0, cores=16).urgent == 0, "a GPU runs one batch at a time"
    assert plan_threads(CPU, 0, 0, 0, cores=2, urgent=0).urgent == 0
    assert plan_threads(GPU, 0, 0, 0, cores=2, urgent=2).urgent == 2


def test_a_cpu_shares_its_cores_between_two_workers() -> None:
    assert plan_threads(CPU, 0, 0, 0, cores=2) == Threads(2, 1, 1, 1)
    assert plan_threads(CPU, 0, 0, 0, cores=16) == Threads(2, 8, 8, 1)
    assert plan_threads(CPU, 0, 0, 0, cores=1) == Threads(1, 1, 1, 0)
    assert plan_threads(CPU, 4, 0, 3, cores=16) == Threads(4, 4, 3, 1)
    assert plan_threads(CPU, 1, 0, 0, cores=8) == Threads(1, 8, 4, 1), "one worker gets every core"
    assert plan_threads(CPU, 0, 3, 0, cores=2) == Threads(2, 3, 1, 1)


@given(cores=st.integers(1, 256), workers=st.integers(0, 64), intra=st.integers(0, 256), decode=st.integers(0, 64))
def test_the_plan_always_runs_something_and_never_oversubscribes_by_default(
    cores: int, workers: int, intra: int, decode: int
) -> None:
    plan = plan_threads(CPU, workers, intra, decode, cores)
    assert plan.workers >= 1 and plan.intra_op >= 1 and plan.decode >= 1
    assert plan.decode == (decode or max(1, cores // 2))
    if workers == 0:
        assert plan.workers <= max(1, cores)
    if intra == 0:
        assert plan.workers * plan.intra_op <= max(cores, plan.workers)


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path) -> None:
    import os

    from app.inference.device import cpu_cores

    visible = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    limit.write_text("100000 100000\n")
    assert cpu_cores(limit) == 1
    limit.write_text("150000 100000\n")
    assert cpu_cores(limit) == min(visible, 2), "a fraction of a core rounds up"
    limit.write_text("max 100000\n")
    assert cpu_cores(limit) == visible
    assert cpu_cores(tmp_path / "missing") == visible
    limit.write_text("garbage")
    assert cpu_cores(limit) == visible
