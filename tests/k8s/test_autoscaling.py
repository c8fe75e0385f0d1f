"""Autoscaling reads a metric the service really exports, from the series Prometheus really has.

The KEDA query is checked three ways: its metric names are families the app registers
(``Metrics().registry``), its ``namespace`` and ``job`` matchers are the ones the
ServiceMonitor's scrape produces, and ``promtool`` parses it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.telemetry.metrics import Metrics
from tests.k8s.conftest import TOOL_TIMEOUT_S, find_tool, only, render
from tests.stack.promql import parse

PLAIN_OVERLAYS = ("cpu", "gpu")
# labels Prometheus attaches at scrape time, not the service
TARGET_LABELS = {"namespace", "job", "pod", "instance", "service", "endpoint", "container"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


def exported_series() -> set[str]:
    """Every series name the app's registry can expose, with the suffixes of each type."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def prometheus_trigger(overlay: str) -> dict[str, Any]:
    scaled = only(render(overlay), "ScaledObject")
    triggers = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert len(triggers) == 1
    trigger: dict[str, Any] = triggers[0]
    return trigger


def matcher_values(query: str, label: str) -> set[str]:
    return set(re.findall(rf'\b{label}\s*=\s*"([^"]*)"', query))


@pytest.mark.parametrize("overlay", PLAIN_OVERLAYS)
def test_the_query_reads_the_queue_depth_the_service_exports(overlay: str) -> None:
    query = prometheus_trigger(overlay)["metadata"]["query"]
    parsed = parse(query)
    names = {selector.name for selector in parsed.selectors}
    assert names == {"ai_backend_queue_depth"}, query
    assert names <= exported_series()
    assert "sum" in parsed.functions, "one number for all replicas: KEDA divides it by the threshold"
    labels = set().union(*(s.labels for s in parsed.selectors)) | parsed.grouping
    assert labels <= TARGET_LABELS | {"model", "version", "lane"}, labels


@pytest.mark.parametrize("overlay", PLAIN_OVERLAYS)
def test_the_query_selects_the_series_the_service_monitor_scrapes(overlay: str) -> None:
    manifests = render(overlay)
    query = prometheus_trigger(overlay)["metadata"]["query"]
    scaled = only(manifests, "ScaledObject")
    assert matcher_values(query, "namespace") == {scaled["metadata"]["namespace"]}, query
    monitor = only(manifests, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [
        m for m in manifests if m["kind"] == "Service" and selector.items() <= m["metadata"].get("labels", {}).items()
    ]
    assert len(services) == 1, "the monitor must scrape one Service, or series double up"
    assert "jobLabel" not in monitor["spec"], "job is then the Service's name"
    assert matcher_values(query, "job") == {services[0]["metadata"]["name"]}, query
    ports = {p["name"] for p in services[0]["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


@pytest.mark.parametrize("overlay", PLAIN_OVERLAYS)
def test_the_scaler_targets_the_deployment_and_keeps_a_replica_through_a_disruption(overlay: str) -> None:
    manifests = render(overlay)
    spec = only(manifests, "ScaledObject")["spec"]
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert only(manifests, "Deployment", target["name"])
    assert "replicas" not in only(manifests, "Deployment", target["name"])["spec"], "the scaler owns the count"
    budget = only(manifests, "PodDisruptionBudget")["spec"]
    assert spec["minReplicaCount"] > budget["maxUnavailable"]
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert float(prometheus_trigger(overlay)["metadata"]["threshold"]) > 0


def test_promtool_parses_the_query(tmp_path: Path) -> None:
    promtool = find_tool("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run installs it)")
    queries = {prometheus_trigger(overlay)["metadata"]["query"] for overlay in PLAIN_OVERLAYS}
    rules = tmp_path / "keda.yml"
    body = "".join(f"      - record: keda:query_{i}\n        expr: '{q}'\n" for i, q in enumerate(sorted(queries)))
    rules.write_text(f"groups:\n  - name: keda\n    rules:\n{body}")
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
