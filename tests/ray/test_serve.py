"""The app on a real local Ray cluster, through Serve's HTTP proxy on a loopback port.

One cluster for the module (``ray.init`` takes about 10 s here, and each replica imports
torch): application ``main`` (2 replicas, a 200 ms normal window so the lanes differ
clearly, no urgent fill) and application ``tight`` (1 replica, 2 ongoing requests and 2
queued at most, a 1 s window, so that overflow is certain). Every load is bounded in
requests and time, and only 127.0.0.1 is spoken to. Nothing asserts an absolute time:
lanes are compared within one run.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support import MODELS_DIR, REPO_ROOT, free_ports, sample_png

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.ray

HOST = "127.0.0.1"
COMMON = {
    "config_file": str(REPO_ROOT / "config" / "default.toml"),
    "model.repository": str(MODELS_DIR),
    "model.device": "cpu",
    "model.intra_op_threads": "1",
    "num_cpus": "0.5",
    "logging.access_log": "false",
    "logging.level": "WARNING",
}
MAIN = {
    **COMMON,
    "num_replicas": "2",
    "batching.normal.window_ms": "200",
    "batching.urgent_fill": "false",
    # spans only for requests that arrive sampled (the traceparent test), none under load
    "telemetry.exporter": "console",
    "telemetry.sampling_ratio": "0",
    "metrics_interval_s": "1",
}
TIGHT = {
    **COMMON,
    "num_replicas": "1",
    "max_ongoing_requests": "2",
    "max_queued_requests": "2",
    "batching.normal.window_ms": "1000",
}


@dataclass
class Cluster:
    url: str
    metrics_url: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    from app.ray_app import build

    http_port, metrics_port = free_ports(2, HOST)
    for attempt in (1, 2):  # Ray's own start-up: its raylet registering with its GCS timed out once in CI
        try:
            ray.init(
                address="local",
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                _metrics_export_port=metrics_port,
            )
            break
        except Exception as exc:
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
    try:
        serve.start(http_options={"host": HOST, "port": http_port})
        serve.run(build(MAIN), name="main", route_prefix="/")
        serve.run(build(TIGHT), name="tight", route_prefix="/tight")
        yield Cluster(f"http://{HOST}:{http_port}", f"http://{HOST}:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()


def _png_headers(**extra: str) -> dict[str, str]:
    return {"Content-Type": "image/png", **extra}


async def _predict(client: httpx.AsyncClient, path: str = "/predict", **headers: str) -> httpx.Response:
    return await client.post(path, content=sample_png(7), headers=_png_headers(**headers))


def test_the_probes_answer_through_the_proxy(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        assert client.get("/livez").json() == {"status": "alive"}
        assert client.get("/readyz").json() == {"status": "ready"}
        health = client.get("/healthz")
        assert health.status_code == 200
        assert health.json()["models"][0]["batcher_running"] is True
        response = client.post("/predict", content=sample_png(7), headers=_png_headers(**{"X-Request-ID": "ray-1"}))
        assert response.status_code == 200
        assert response.json()["predictions"][0]["label"] == "7"
        # Serve's proxy sets X-Request-ID too; the replica leaves it one header, not two
        assert response.headers.get_list("x-request-id") == ["ray-1"]
        assert response.json()["request_id"] == "ray-1"


async def test_64_concurrent_requests_ride_batches_larger_than_5(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
        responses = await asyncio.gather(*(_predict(client) for _ in range(64)))
    assert [r.status_code for r in responses] == [200] * 64
    sizes = [r.json()["batch_size"] for r in responses]
    # Serve's default max_ongoing_requests (5) would cap every batch at 5
    assert max(sizes) > 5, sizes
    assert statistics.mean(sizes) > 5, sizes


async def test_urgent_requests_are_answered_faster_than_normal_ones_under_load(cluster: Cluster) -> None:
    latencies: dict[str, list[float]] = {"urgent": [], "normal": []}
    deadline = time.monotonic() + 4.0

    async def client_loop(client: httpx.AsyncClient, urgency: str, rounds: int) -> None:
        for _ in range(rounds):
            if time.monotonic() > deadline:
                return
            started = time.perf_counter()
            response = await _predict(client, **{"X-Urgency": urgency})
            assert response.status_code == 200, response.text
            lane = response.json()["lane"]
            assert lane == ("urgent" if urgency == "high" else "normal")
            latencies[lane].append(time.perf_counter() - started)

    async with httpx.AsyncClient(base_url=cluster.url, timeout=60, limits=httpx.Limits(max_connections=32)) as client:
        await asyncio.gather(
            *(client_loop(client, "normal", 20) for _ in range(12)),
            *(client_loop(client, "high", 60) for _ in range(4)),
        )
    assert len(latencies["urgent"]) >= 8 and len(latencies["normal"]) >= 12, latencies
    urgent, normal = statistics.median(latencies["urgent"]), statistics.median(latencies["normal"])
    assert urgent < normal, (urgent, normal)


async def test_queue_overflow_is_a_503(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60, limits=httpx.Limits(max_connections=16)) as client:
        responses = await asyncio.gather(*(_predict(client, "/tight/predict") for _ in range(12)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    # 2 in the replica and 2 queued in the proxy's router at a time, each batch held by the
    # 1 s window: most of the 12 are refused at once (a slot that frees while the burst is
    # still arriving can take one more, so the bound is loose)
    assert statuses.count(200) >= 2, statuses
    assert statuses.count(503) >= 4, statuses
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["retry-after"] == "1", refused.headers


def test_the_lifespan_runs_once_per_replica(cluster: Cluster) -> None:
    handle = serve.get_app_handle("main")
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(60):
        info = handle.replica_info.remote().result(timeout_s=30)
        seen[info["replica"]] = info
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    assert [info["lifespan_starts"] for info in seen.values()] == [1, 1]
    assert len({info["pid"] for info in seen.values()}) == 2, "each replica is its own process"
    assert all(info["ready"] for info in seen.values())


def test_an_incoming_traceparent_continues(cluster: Cluster) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        response = client.post(
            "/predict", content=sample_png(3), headers=_png_headers(traceparent=f"00-{trace_id}-{parent}-01")
        )
    assert response.status_code == 200
    assert response.headers["x-trace-id"] == trace_id


def test_every_replica_exports_its_metrics_through_ray(cluster: Cluster) -> None:
    """Scraped from Ray's metrics port, not through the proxy: both replicas, each tagged."""
    handle = serve.get_app_handle("main")
    replicas = {handle.replica_info.remote().result(timeout_s=30)["replica"] for _ in range(30)}
    pattern = re.compile(r'^ray_ai_backend_requests_total\{[^}]*application="main"[^}]*replica="([^"]+)"', re.M)
    found: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
        found = set(pattern.findall(text))
        if found >= replicas:
            break
        time.sleep(2)
    assert found >= replicas, (found, replicas)
    assert "ray_ai_backend_request_duration_seconds_bucket{" in text


def test_the_health_check_passes_in_a_serving_replica(cluster: Cluster) -> None:
    """Serve's check_health, called as Serve calls it: the ``/readyz`` condition it imports in the replica."""
    handle = serve.get_app_handle("main")
    assert handle.check_health.remote().result(timeout_s=30) is None


def test_serves_per_request_timeout_header_bounds_the_wait_with_a_408(cluster: Cluster) -> None:
    """What docs/ray.md tells a client whose deadline must count Serve's queue: Serve's proxy
    honours ``X-Request-Timeout-Seconds`` and answers 408 itself, in plain text, past it (here
    a lone request waits out the 1 s window of ``tight``; the app's own deadline is 5 s)."""
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        response = client.post(
            "/tight/predict",
            content=sample_png(7),
            headers=_png_headers(**{"X-Request-Timeout": "5000", "X-Request-Timeout-Seconds": "0.3"}),
        )
    assert response.status_code == 408, response.text
    assert "timed out after 0.3s" in response.text, response.text
