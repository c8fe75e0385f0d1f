"""How many batches run at once on a device, and how many torch threads each gets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from app.inference.device import CpuLimit, Threads, cpu_cores, cpu_limit, fallback_intra_op, plan_threads

CPU, GPU = torch.device("cpu"), torch.device("cuda:0")


def test_a_gpu_gets_one_worker_and_one_torch_thread() -> None:
    assert plan_threads(GPU, 0, 0, 0, cores=16) == Threads(1, 1, 8, 0), "one torch thread: the GPU computes"
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


def test_the_cpu_fallback_gets_the_cpus_plan_for_the_device_threads_there_are() -> None:
    """On a GPU one device thread runs one torch thread; the CPU fallback it then runs gets every
    core (one device thread), unless ``model.intra_op_threads`` says otherwise."""
    gpu = plan_threads(GPU, 0, 0, 0, cores=16)
    assert fallback_intra_op(gpu, 0, cores=16) == 16
    assert fallback_intra_op(plan_threads(GPU, 2, 0, 0, cores=16), 0, cores=16) == 8, "two device threads share them"
    assert fallback_intra_op(gpu, 4, cores=16) == 4, "explicit settings win"
    assert fallback_intra_op(gpu, 0, cores=1) == 1


@given(
    cores=st.integers(1, 256),
    workers=st.integers(0, 64),
    intra=st.integers(0, 256),
    decode=st.sampled_from(["pool", "batch", "auto"]),
)
def test_on_a_cpu_the_fallback_keeps_the_plans_torch_threads(cores: int, workers: int, intra: int, decode: str) -> None:
    plan = plan_threads(CPU, workers, intra, 0, cores, decode_mode=decode)
    assert fallback_intra_op(plan, intra, cores) == plan.intra_op


def cgroup_tree(root: Path, files: dict[str, str]) -> Path:
    """A fake ``/sys/fs/cgroup`` holding ``files`` (paths relative to it)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})


@pytest.mark.usefixtures("four_cpus")
def test_a_cgroup_v2_quota_caps_the_cores_and_a_fraction_rounds_up_for_threads(tmp_path: Path) -> None:
    own = tmp_path / "self-cgroup"
    own.write_text("0::/\n")
    root = cgroup_tree(tmp_path / "cg", {"cpu.max": "100000 100000\n"})
    assert cpu_cores(root, own) == 1
    (root / "cpu.max").write_text("150000 100000\n")
    assert cpu_limit(root, own).cpus == 1.5, "the limit keeps the fraction"
    assert cpu_cores(root, own) == 2, "threads come whole: a fraction of a core rounds up"
    for text in ("max 100000\n", "garbage", "0 100000\n"):
        (root / "cpu.max").write_text(text)
        assert cpu_limit(root, own) == CpuLimit(4.0, "affinity mask"), text
    assert cpu_cores(tmp_path / "missing", own) == 4


@pytest.mark.usefixtures("four_cpus")
def test_the_process_s_own_cgroup_v2_and_every_parent_of_it_are_read(tmp_path: Path) -> None:
    """Without a cgroup namespace the quota is not at the root: it is on the process's own
    cgroup (or a parent), named in /proc/self/cgroup."""
    own = tmp_path / "self-cgroup"
    own.write_text("0::/kubepods/pod1/app\n")
    root = cgroup_tree(
        tmp_path / "cg", {"kubepods/pod1/app/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "50000 100000\n"}
    )
    found = cpu_limit(root, own)
    assert found.cpus == 0.5 and "kubepods/pod1/cpu.max" in found.source
    assert cpu_cores(root, own) == 1, "at least one"
    own.write_text("0::/elsewhere\n")  # its folder not visible (a namespace): the root's quota
    cgroup_tree(root, {"cpu.max": "300000 100000\n"})
    assert cpu_limit(root, own).cpus == 3.0


@pytest.mark.usefixtures("four_cpus")
def test_a_cgroup_v1_cfs_quota_caps_the_cores(tmp_path: Path) -> None:
    """A cgroup v1 host (this CI's) has no cpu.max: the quota is cpu.cfs_quota_us / cpu.cfs_period_us."""
    own = tmp_path / "self-cgroup"
    own.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n")
    root = cgroup_tree(
        tmp_path / "cg", {"cpu,cpuacct/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    )
    found = cpu_limit(root, own)
    assert found.cpus == 1.5 and found.source.startswith("cgroup v1"), found
    assert cpu_cores(root, own) == 2
    cgroup_tree(root, {"cpu/docker/abc/cpu.cfs_quota_us": "100000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cpu_cores(root, own) == 1, "the process's own cgroup, under the cpu mount"
    for name in ("cpu,cpuacct/cpu.cfs_quota_us", "cpu/docker/abc/cpu.cfs_quota_us"):
        (root / name).write_text("-1\n")  # no quota
    assert cpu_cores(root, own) == 4


def test_the_affinity_mask_caps_a_larger_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    own = tmp_path / "self-cgroup"
    own.write_text("0::/\n")
    root = cgroup_tree(tmp_path / "cg", {"cpu.max": "300000 100000\n"})
    assert cpu_limit(root, own) == CpuLimit(1.0, "affinity mask")
    assert cpu_cores(root, tmp_path / "no-proc") == 1
