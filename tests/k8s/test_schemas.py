"""Each kustomization renders, and what it renders is valid Kubernetes for the stated releases.

``kubectl kustomize`` (or ``kustomize build``) piped to ``kubernetes-validate --strict``:
strict rejects unknown fields, so a misspelt or misplaced field fails here and not at
``kubectl apply``. kubernetes-validate only knows the built-in kinds: it warns and passes
on anything else, so the warnings are checked to name exactly the expected custom
resources (a removed apiVersion such as policy/v1beta1 would otherwise slip through).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.k8s.conftest import (
    CUSTOM_RESOURCES,
    ENVOY,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    TOOL_TIMEOUT_S,
    render_text,
    require_kubernetes_validate,
)

_PASSED = re.compile(r"^INFO .* passed for resource (\S+)/(\S+) against version (\S+)$")
_NO_SCHEMA = re.compile(r"^WARN .* Couldn't find schema for kind (\S+) with api version (\S+) for kubernetes version")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", [*OVERLAYS, ENVOY])
def test_the_rendering_is_valid_for_the_kubernetes_release(name: str, version: str) -> None:
    validate = require_kubernetes_validate()
    rendered = render_text(name)
    result = subprocess.run(
        [validate, "--strict", "--kubernetes-version", version, "-"],
        input=rendered,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    lines = report.splitlines()
    passed = [m.groups() for m in map(_PASSED.match, lines) if m]
    unknown = {m.groups() for m in map(_NO_SCHEMA.match, lines) if m}
    assert unknown == CUSTOM_RESOURCES[name], report
    assert {v for _, _, v in passed} == {version.rsplit(".", 1)[0]}, report
    documents = len(re.findall(r"^kind: ", rendered, flags=re.MULTILINE))
    unknown_documents = len([line for line in lines if _NO_SCHEMA.match(line)])
    assert len(passed) + unknown_documents == documents, report


@pytest.mark.parametrize(
    ("kind", "api_version"),
    sorted({resource for resources in CUSTOM_RESOURCES.values() for resource in resources}),
)
def test_custom_resources_are_checked_elsewhere(kind: str, api_version: str) -> None:
    pytest.skip(
        f"kubernetes-validate has no schema for {kind} ({api_version}), a custom resource: "
        "its required fields are checked in tests/k8s/test_custom_resources.py"
    )
