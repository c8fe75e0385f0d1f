"""The pods the overlays run agree with the service they run.

Each pod's settings are built the way the pod builds them (its ConfigMap and ``env``
through ``load_settings``), so the checks hold against the real defaults and rules:
a probe names a real route, the drain fits in the grace period, the model repository
and the admin token are where the settings say, one process serves one device.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from app.inference.device import plan_threads
from app.settings import ENV_PREFIX, Settings, env_name
from app.telemetry.tracing import DEFAULT_EXPORT_TIMEOUT_S
from tests.k8s.conftest import (
    ENVOY,
    OVERLAYS,
    Manifest,
    only,
    pod_env,
    pod_templates,
    render,
    serves_get,
    settings_for,
)

PLAIN_OVERLAYS = ("cpu", "gpu")  # the overlays that run the Deployment
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# after the drain: flush telemetry (telemetry.export_timeout_s), release the device, exit
MIN_EXIT_MARGIN_S = 10


def deployment(overlay: str) -> Manifest:
    return only(render(overlay), "Deployment", "ai-backend")


def server_container(overlay: str) -> Manifest:
    return only_container(deployment(overlay)["spec"]["template"])


def only_container(template: Manifest) -> Manifest:
    containers = template["spec"]["containers"]
    assert len(containers) == 1, "one container per pod: the service is one process per device"
    container: Manifest = containers[0]
    return container


def settings_of(overlay: str, template: Manifest | None = None) -> Settings:
    manifests = render(overlay)
    return settings_for(pod_env(template or deployment(overlay)["spec"]["template"], manifests))


def all_env_names(model: type[BaseModel], location: tuple[str, ...] = ()) -> set[str]:
    names: set[str] = set()
    for field, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= all_env_names(annotation, (*location, field))
        else:
            names.add(env_name((*location, field)))
    return names


@pytest.mark.parametrize("overlay", PLAIN_OVERLAYS)
def test_the_grace_period_outlasts_the_pre_stop_sleep_and_the_drain(overlay: str) -> None:
    pod = deployment(overlay)["spec"]["template"]["spec"]
    settings = settings_of(overlay)
    pre_stop = server_container(overlay)["lifecycle"]["preStop"]
    assert "sleep" in pre_stop, "the preStop hook must be a sleep of known length"
    sleep_s = pre_stop["sleep"]["seconds"]
    drain_s = settings.server.shutdown_grace_s
    grace_s = pod["terminationGracePeriodSeconds"]
    assert sleep_s >= 5, "balancers need a few seconds to stop sending new work"
    assert grace_s > sleep_s + drain_s, (grace_s, sleep_s, drain_s)
    # the pods set no OTEL_EXPORTER_OTLP_*TIMEOUT: unset, the export timeout is the default
    margin = max(MIN_EXIT_MARGIN_S, settings.telemetry.export_timeout_s or DEFAULT_EXPORT_TIMEOUT_S)
    assert grace_s - sleep_s - drain_s >= margin, f"leave {margin} s after the drain to flush and exit"


@pytest.mark.parametrize("overlay", PLAIN_OVERLAYS)
def test_every_probe_asks_a_real_route_on_the_served_port(overlay: str) -> None:
    container = server_container(overlay)
    settings = settings_of(overlay)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in PROBES:
        check = container[probe]["httpGet"]
        assert serves_get(settings, check["path"]), f"{probe} asks {check['path']}, which the app does not serve"
        assert ports.get(check["port"], check["port"]) == settings.server.port, probe
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", "readiness turns 503 while draining"
    # liveness must not depend on the model or the device: a busy GPU is not a dead process
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    assert settings.server.host == "0.0.0.0", "the kubelet probes the pod's address, not loopback"


@pytest.mark.parametrize("overlay", PLAIN_OVERLAYS)
def test_one_process_serves_one_device_per_pod(overlay: str) -> None:
    container = server_container(overlay)
    command = [*container.get("command", []), *container.get("args", [])]
    assert command == ["ai-backend", "serve"], command
    env = pod_env(deployment(overlay)["spec"]["template"], render(overlay))
    assert not {"WEB_CONCURRENCY", "UVICORN_WORKERS"} & set(env)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_in_the_config_map_is_real_and_valid(overlay: str) -> None:
    known = all_env_names(Settings)
    for config_map in (m for m in render(overlay) if m["kind"] == "ConfigMap"):
        names = {name for name in config_map["data"] if name.startswith(ENV_PREFIX)}
        assert names <= known, f"not settings: {sorted(names - known)}"
        # secrets go in Secrets: only the file names of the token and key are configured
        assert not names & {"AI_SERVICE_ADMIN__TOKEN", "AI_SERVICE_SERVER__API_KEY"}
    for _, template in pod_templates(render(overlay)):
        settings_of(overlay, template)  # raises SettingsError naming the bad value


def test_the_gpu_overlay_asks_for_one_gpu_and_serves_from_it() -> None:
    container = server_container("gpu")
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert settings_of("gpu").model.device.startswith("cuda"), "a pod without its GPU must fail, not fall back"
    tolerations = deployment("gpu")["spec"]["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)


def test_the_cpu_overlay_asks_for_no_gpu_and_sizes_torch_to_its_cpus() -> None:
    for where, template in pod_templates(render("cpu")):
        for container in template["spec"]["containers"]:
            resources = container.get("resources", {})
            for section in ("requests", "limits"):
                assert "nvidia.com/gpu" not in resources.get(section, {}), where
    settings = settings_of("cpu")
    assert settings.model.device == "cpu"
    cpus = int(float(server_container("cpu")["resources"]["limits"]["cpu"]))
    model = settings.model
    # the plan the service makes in the pod, whose CPU limit it reads from its cgroup
    plan = plan_threads(
        torch.device("cpu"),
        model.device_workers,
        model.intra_op_threads,
        settings.server.preprocess_workers,
        cpus,
        model.urgent_workers,
        settings.server.decode,
        model.normal_nice,
    )
    torch_threads = plan.intra_op * plan.workers
    assert 0 < torch_threads <= cpus, "torch would size its pool from the node's cores and be throttled"
    busy = torch_threads + (0 if plan.decode_in_batch else plan.decode)  # decode threads idle where batches decode
    assert busy == cpus, f"{plan}: the pod's CPUs not all at work, or more threads than CPUs"


def test_the_ray_workers_have_a_gpu_for_each_replica() -> None:
    ray = only(render("ray"), "RayService")
    for group in ray["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        limits = only_container(group["template"])["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1, group["groupName"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_model_repository_is_mounted_read_only_where_the_settings_look(overlay: str) -> None:
    for where, template in pod_templates(render(overlay)):
        check_model_mount(overlay, where, template)


def check_model_mount(overlay: str, where: str, template: Manifest) -> None:
    manifests = render(overlay)
    repository = str(settings_of(overlay, template).model.repository)
    mounts = {m["mountPath"]: m for m in only_container(template)["volumeMounts"]}
    assert repository in mounts, f"{where}: nothing mounted at {repository}"
    assert mounts[repository].get("readOnly") is True, where
    volume = volume_named(template, mounts[repository]["name"])
    claim = volume["persistentVolumeClaim"]
    assert claim.get("readOnly") is True, where
    pvc = only(manifests, "PersistentVolumeClaim", claim["claimName"])
    assert "ReadOnlyMany" in pvc["spec"]["accessModes"], "every replica mounts it at once"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_admin_token_file_comes_from_a_mounted_secret(overlay: str) -> None:
    for where, template in pod_templates(render(overlay)):
        check_token_mount(overlay, where, template)


def check_token_mount(overlay: str, where: str, template: Manifest) -> None:
    settings = settings_of(overlay, template)
    assert settings.admin.token is None, "the token itself never sits in a ConfigMap"
    token_file = settings.admin.token_file
    assert token_file is not None, where
    token_path = PurePosixPath(token_file)
    mounts = [m for m in only_container(template)["volumeMounts"] if token_path.is_relative_to(m["mountPath"])]
    assert mounts, f"{where}: nothing mounted over {token_file}"
    mount = mounts[0]
    assert mount.get("readOnly") is True
    secret = volume_named(template, mount["name"])["secret"]
    inside = str(token_path.relative_to(mount["mountPath"]))
    items = secret.get("items")
    assert items is None or inside in {item["path"] for item in items}, f"{where}: the Secret has no {inside}"


def volume_named(template: Manifest, name: str) -> dict[str, Any]:
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert name in volumes, f"no volume {name}"
    volume: dict[str, Any] = volumes[name]
    return volume


@pytest.mark.parametrize("name", [*OVERLAYS, ENVOY])
def test_every_pod_runs_unprivileged_on_a_read_only_root(name: str) -> None:
    for where, template in pod_templates(render(name)):
        check_unprivileged(f"{name}: {where}", template)


def check_unprivileged(where: str, template: Manifest) -> None:
    pod = template["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True, where
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
    # the Ray head's pod runs KubeRay's autoscaler, which needs the API: its token is mounted
    autoscaler = "ray-head" in [c["name"] for c in pod["containers"]]
    assert pod.get("automountServiceAccountToken") is autoscaler, where
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, where
        assert context["allowPrivilegeEscalation"] is False, where
        assert context["capabilities"]["drop"] == ["ALL"], where
        tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp, f"{where}: /tmp must be writable"
        assert "emptyDir" in volume_named(template, tmp[0]["name"]), where


@pytest.mark.parametrize("name", [*OVERLAYS, ENVOY])
def test_every_container_has_requests_and_a_memory_limit(name: str) -> None:
    for where, template in pod_templates(render(name)):
        for container in template["spec"]["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert "memory" in resources["limits"], where


@pytest.mark.parametrize("overlay", PLAIN_OVERLAYS)
def test_the_service_the_budget_and_the_spread_select_the_pods(overlay: str) -> None:
    manifests = render(overlay)
    template = deployment(overlay)["spec"]["template"]
    labels = template["metadata"]["labels"]

    def selects(selector: dict[str, str]) -> bool:
        return bool(selector) and selector.items() <= labels.items()

    assert selects(deployment(overlay)["spec"]["selector"]["matchLabels"])
    service = only(manifests, "Service", "ai-backend")
    assert selects(service["spec"]["selector"])
    ports = {p["name"] for p in only_container(template)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    budget = only(manifests, "PodDisruptionBudget")
    assert selects(budget["spec"]["selector"]["matchLabels"])
    spread = template["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} >= {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
    assert all(selects(c["labelSelector"]["matchLabels"]) for c in spread)
