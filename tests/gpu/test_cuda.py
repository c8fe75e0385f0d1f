"""On a CUDA device, for real: fp16 weights on cuda:0, the memory they take, an out-of-memory
the device itself raises (split, retried, the ceiling lowered and lifted again), and the memory
given back at shutdown.

Skipped where torch sees no CUDA device (CI and the 2-core machines have none); elsewhere the
tests/integration suites cover the same paths with injected faults. ``scripts/gpu_check.sh``
runs these with the end-to-end server tests and the GPU throughput figures. The real
out-of-memory test comes last: on the first GPU run it crashed the process (see its comment).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.inference.loader import LayeredModel
from app.inference.repository import Repository
from tests.conftest import SettingsFactory
from tests.e2e.server import spawn_digits
from tests.support import (
    DIGITS_DIR,
    LABELS,
    MODEL_NAME,
    metric_samples,
    noise_png,
    running_app,
    sample_png,
    top_label,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is false)"),
]

CUDA = torch.device("cuda:0")
MIB = 1 << 20


def load(root: Path, name: str, device: torch.device, dtype: torch.dtype) -> LayeredModel:
    repository = Repository(root)
    version = next(entry.latest for entry in repository.models() if entry.name == name)
    model = LayeredModel.load(repository.folder(name, version), repository.manifest(name, version), device, dtype)
    model.load_all_heads()
    return model


@pytest.fixture(scope="module")
def mobilenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mobilenet_v3_small exported (seed 0) into a repository of its own: 224 x 224 inputs, whose
    activations make the memory of a batch of a few hundred count."""
    from app.inference.export import export_torchvision

    root = tmp_path_factory.mktemp("mobilenet")
    export_torchvision("mobilenet_v3_small", root, seed=0)
    return root


@pytest.fixture
def memory_cap() -> Iterator[None]:
    """The test may cap this process's CUDA memory; the cap is lifted however it ends."""
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
        torch.cuda.empty_cache()


def test_fp16_on_cuda_gives_the_cpu_fp32_answers() -> None:
    on_gpu = load(DIGITS_DIR.parent, MODEL_NAME, CUDA, torch.float16)
    on_cpu = load(DIGITS_DIR.parent, MODEL_NAME, torch.device("cpu"), torch.float32)
    batch = on_cpu.dummy_batch(64)
    with torch.inference_mode():
        features = on_gpu.features(batch)
        gpu = on_gpu.probabilities(batch).cpu()
        cpu = on_cpu.probabilities(batch)
    assert (features.device.type, features.dtype) == ("cuda", torch.float16), "the backbone ran in fp16 on the GPU"
    assert gpu.dtype == torch.float32, "probabilities come back in fp32"
    difference = (gpu - cpu).abs().max().item()
    print(f"fp16 on {torch.cuda.get_device_name(CUDA)} against fp32 on the CPU: max |p| difference {difference:.2e}")
    assert difference < 2e-2
    agree = (gpu.argmax(1) == cpu.argmax(1)).float().mean().item()
    assert agree >= 0.95, f"top-1 agrees on {agree:.0%} of 64 random inputs"


async def test_auto_serves_fp16_on_cuda_0_and_shows_its_memory(make_settings: SettingsFactory) -> None:
    settings = make_settings(model={"device": "auto", "dtype": "auto", "warmup": True})
    async with running_app(settings) as running:
        assert running.fatal == []
        health = (await running.client.get("/healthz")).json()
        assert (health["status"], health["device"], health["dtype"]) == ("ok", "cuda:0", "float16")
        (model,) = health["models"]
        assert (model["device"], model["dtype"]) == ("cuda:0", "float16")
        served = running.service.models[MODEL_NAME].runner.model
        assert isinstance(served, LayeredModel) and served.largest_batch is not None, "batches padded on CUDA"
        free, total = torch.cuda.mem_get_info(CUDA)
        assert health["memory"]["total_bytes"] == total
        assert 0 < health["memory"]["free_bytes"] <= total

        answers = await asyncio.gather(*(running.predict_png(sample_png(int(label))) for label in LABELS))
        assert [r.status_code for r in answers] == [200] * 10
        assert [top_label(r.json()) for r in answers] == list(LABELS), "the bundled digits read right in fp16"

        page = (await running.client.get("/metrics")).text
        memory = metric_samples(page, "ai_backend_device_memory_bytes")
        held = {dict(labels)["kind"]: value for labels, value in memory.items()}
        print(f"after warm-up: allocated {held['allocated'] / MIB:.1f} MiB, reserved {held['reserved'] / MIB:.1f} MiB")
        assert 0 < held["allocated"] <= held["reserved"], "the warmed model's memory is reported"
        assert metric_samples(page, "ai_backend_device_memory_total_bytes") == {(): float(total)}


async def test_memory_goes_back_to_the_driver_at_shutdown(make_settings: SettingsFactory) -> None:
    # cuBLAS and cuDNN keep a workspace per handle for the process's life: made before counting
    with torch.inference_mode():
        torch.nn.functional.conv2d(torch.ones(1, 3, 8, 8, device=CUDA), torch.ones(4, 3, 3, 3, device=CUDA))
        torch.ones(8, 8, device=CUDA, dtype=torch.float16) @ torch.ones(8, 8, device=CUDA, dtype=torch.float16)
    torch.cuda.synchronize(CUDA)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(CUDA)
    settings = make_settings(model={"device": "cuda:0", "dtype": "float16", "warmup": True})
    async with running_app(settings) as running:
        assert (await running.predict_png(sample_png(3))).status_code == 200
        serving = torch.cuda.memory_reserved(CUDA)
        assert serving > before
    after = torch.cuda.memory_reserved(CUDA)
    print(f"reserved: {before / MIB:.1f} MiB before, {serving / MIB:.1f} serving, {after / MIB:.1f} after shutdown")
    assert after <= before, "the closed service holds no device memory"


def test_the_served_process_runs_on_cuda_0_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    """The README's serve command on a GPU machine: its defaults pick cuda:0 in fp16; SIGTERM drains."""
    import httpx

    server = spawn_digits(tmp_path, env={"AI_SERVICE_MODEL__WARMUP": "true"})
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=10.0) as client:
            health = client.get("/healthz").json()
            assert (health["status"], health["device"], health["dtype"]) == ("ok", "cuda:0", "float16")
            answer = client.post("/predict", content=sample_png(7), headers={"Content-Type": "image/png"})
            assert answer.status_code == 200 and top_label(answer.json()) == "7"
    finally:
        code = server.stop()
    assert code == 0, server.stderr()[-4000:]
    assert "drained in" in server.stderr()


def peak_bytes(model: LayeredModel, size: int) -> int:
    """What a batch of ``size`` takes on the device beyond what is allocated already."""
    torch.cuda.synchronize(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    before = torch.cuda.memory_allocated(CUDA)
    with torch.inference_mode():
        model.probabilities(model.dummy_batch(size))
    torch.cuda.synchronize(CUDA)
    return torch.cuda.max_memory_allocated(CUDA) - before


async def test_a_real_out_of_memory_splits_the_batch_and_the_ceiling_climbs_back(
    make_settings: SettingsFactory, mobilenet: Path, memory_cap: None
) -> None:
    # one batch of 256 by count (the window never closes first); admission may use all the time left.
    # Warmed, as served: every padded size's convolutions are set up before the memory is capped.
    # Unwarmed (the first GPU run, torch 2.11 + CUDA 13), a size first set up under the cap ran out
    # of memory there, and running that size again crashed the process (SIGSEGV inside the backbone),
    # with or without the cache emptied and the JIT's runtime optimisation on or off.
    normal = {"window_ms": 20_000.0, "max_batch": 256, "max_queue": 512}
    settings = make_settings(
        server={"max_image_bytes": 1 << 20, "preprocess_workers": 4},
        model={
            "repository": mobilenet,
            "names": ["mobilenet_v3_small"],
            "default": "mobilenet_v3_small",
            "device": "cuda:0",
            "dtype": "float16",
            "warmup": True,  # 9 padded sizes, about 2 s of set-up each on the first GPU run
        },
        batching={"normal": normal, "admission_headroom": 1.0},
    )
    images = [noise_png(96, seed) for seed in range(256)]
    async with running_app(settings) as running:
        assert running.fatal == []
        served = running.service.models["mobilenet_v3_small"]
        model = served.runner.model
        assert isinstance(model, LayeredModel)
        small, large = peak_bytes(model, 64), peak_bytes(model, 256)
        assert large > 2 * small, (small, large)
        # room for a batch of 64 and some slack, not for 128: the device itself refuses the rest
        gc.collect()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(CUDA).total_memory
        cap = torch.cuda.memory_reserved(CUDA) + small + 64 * MIB
        torch.cuda.set_per_process_memory_fraction(cap / total, CUDA)
        print(f"batch 64 takes {small / MIB:.0f} MiB, 256 takes {large / MIB:.0f}; capped at {cap / MIB:.0f} MiB")

        answers = await asyncio.gather(*(running.predict_png(image) for image in images))
        assert [r.status_code for r in answers] == [200] * 256, {r.status_code for r in answers}
        sizes = sorted({r.json()["batch_size"] for r in answers})
        ceiling = served.batcher.ceiling
        print(f"answered in batches reported as {sizes}; ceiling now {ceiling}")
        assert ceiling is not None and ceiling <= 128, "the device's out-of-memory lowered the ceiling"
        page = (await running.client.get("/metrics")).text
        faults = metric_samples(page, "ai_backend_device_faults_total")
        ooms = sum(value for labels, value in faults.items() if dict(labels)["fault"] == "out_of_memory")
        assert ooms >= 1, faults
        health = (await running.client.get("/healthz")).json()
        assert (health["status"], health["models"][0]["batch_ceiling"]) == ("ok", ceiling)

        # the memory comes back: batches at the ceiling succeed and it doubles back to none
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
        served.batcher.recovery_batches = 1
        for _ in range(6):
            if served.batcher.ceiling is None:
                break
            more = await asyncio.gather(*(running.predict_png(image) for image in images))
            assert [r.status_code for r in more] == [200] * 256
        assert served.batcher.ceiling is None, "the ceiling climbed back once the memory was there"
