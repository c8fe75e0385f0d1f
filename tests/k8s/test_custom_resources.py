"""The custom resources kubernetes-validate cannot check: their required fields, here.

KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor and KubeRay's RayService
(ray.io/v1): the fields their CRDs require, and the values that must agree with the rest
of the rendering (the RayService's Serve config, its GPUs and its shutdown timing).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.conftest import Manifest, load_yaml, only, render

RAY_BUILDER = "app.ray_app:build"


def ray_service() -> Manifest:
    return only(render("ray"), "RayService")


def serve_config() -> dict[str, Any]:
    text = ray_service()["spec"]["serveConfigV2"]
    assert isinstance(text, str), "serveConfigV2 is a YAML document inside a string"
    config: dict[str, Any] = load_yaml(text)
    return config


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_scaled_object_has_what_keda_requires(overlay: str) -> None:
    scaled = only(render(overlay), "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"]
    assert scaled["spec"]["triggers"]
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert {"serverAddress", "query", "threshold"} <= set(metadata)
        assert metadata["serverAddress"].startswith(("http://", "https://"))
        assert all(isinstance(value, str) for value in metadata.values()), "trigger metadata is string-valued"
        assert trigger.get("metricType", "AverageValue") == "AverageValue", "fallback needs AverageValue"
    fallback = scaled["spec"]["fallback"]
    assert fallback["failureThreshold"] >= 1
    assert scaled["spec"]["minReplicaCount"] <= fallback["replicas"] <= scaled["spec"]["maxReplicaCount"]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_service_monitor_has_what_the_operator_requires(overlay: str) -> None:
    monitor = only(render(overlay), "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint.get("port") or endpoint.get("targetPort")
        assert endpoint["path"] == "/metrics"


def test_the_ray_service_has_what_kuberay_requires() -> None:
    ray = ray_service()
    assert ray["apiVersion"] == "ray.io/v1"
    cluster = ray["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"]
    head = cluster["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head["template"]["spec"]["containers"]
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"]
        assert isinstance(group["rayStartParams"], dict)
        assert group["template"]["spec"]["containers"]
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        # rayStartParams values are strings (they become ray start flags)
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())


def test_the_serve_config_imports_the_ray_app_builder() -> None:
    config = serve_config()
    applications = config["applications"]
    assert [app["import_path"] for app in applications] == [RAY_BUILDER]
    for app in applications:
        assert app["name"]
        assert app["route_prefix"] == "/"
        for deployment in app["deployments"]:
            assert deployment["name"]
            scaling = deployment["autoscaling_config"]
            assert scaling["min_replicas"] <= scaling["max_replicas"]


def test_every_serve_replica_fits_a_worker_and_drains_within_its_grace_period() -> None:
    groups = ray_service()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for app in serve_config()["applications"]:
        for deployment in app["deployments"]:
            wanted = deployment["ray_actor_options"].get("num_gpus", 0)
            drain = deployment["graceful_shutdown_timeout_s"] + deployment["graceful_shutdown_wait_loop_s"]
            for group in groups:
                pod = group["template"]["spec"]
                gpus = int(pod["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
                assert gpus >= wanted, (group["groupName"], deployment["name"])
                assert pod["terminationGracePeriodSeconds"] > drain, (group["groupName"], deployment["name"])


def test_the_ray_app_builder_exists_once_written() -> None:
    module, _, function = RAY_BUILDER.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        pytest.skip(
            f"{module} does not exist yet: the ray overlay's serveConfigV2 imports {RAY_BUILDER} "
            "(docs/kubernetes.md, 'The ray overlay')"
        )
    tree = ast.parse(Path(spec.origin).read_text())
    builders = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    assert builders, f"{module} has no top-level {function}(args) for Ray Serve to call"
