"""docker-compose.yml: valid for Compose, and wired the way the stack needs.

``docker compose config`` (the plugin) or ``docker-compose config`` (v1) validates and
normalises the file without a container engine; the checks below read its output, so
they see what Compose would run, not what the file happens to spell.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.stack.conftest import GRAFANA_DIR, PROMETHEUS_DIR, load_yaml, run_tool
from tests.support import REPO_ROOT

VERSION_TAG = re.compile(r"v?\d+(\.\d+)+[\w.-]*")  # 1.2, v2.55.1, 3.11.13-slim: never latest or a bare major
SHUTDOWN_GRACE_S = 30.0  # server.shutdown_grace_s in config/default.toml
# then the span flush: the export thread's 1 s, and one export up to its 5 s timeout
FLUSH_S = 10.0


def _compose_command() -> list[str]:
    """``docker compose`` where the plugin works, else ``docker-compose``; skip if neither."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The normalised compose file, as Compose itself reads it."""
    result = run_tool(*_compose_command(), "--file", str(REPO_ROOT / "docker-compose.yml"), "config")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = load_yaml("", text=result.stdout)
    return config


def _binds(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(source, target, read_only)`` of each volume, from v1's strings or v2's mappings."""
    binds = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            binds.append((source, target, "ro" in "".join(mode).split(",")))
        else:
            binds.append((volume.get("source", ""), volume["target"], bool(volume.get("read_only"))))
    return binds


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def test_every_image_is_pinned_to_a_version(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        tag = service["image"].split("@")[0].rsplit("/", 1)[-1].partition(":")[2]
        assert VERSION_TAG.fullmatch(tag), f"{name}: {service['image']} is not pinned to a version"


def test_the_service_mounts_the_model_repository_read_only(compose: dict[str, Any]) -> None:
    binds = _binds(compose["services"]["ai-backend"])
    models = [b for b in binds if b[1] == "/srv/models"]
    assert models, binds
    source, _, read_only = models[0]
    assert read_only, "the model repository must be mounted read-only"
    assert Path(source).resolve() == (REPO_ROOT / "models").resolve()


def test_the_service_cannot_write_its_image(compose: dict[str, Any]) -> None:
    service = compose["services"]["ai-backend"]
    assert service.get("read_only") is True
    assert "/tmp" in str(service.get("tmpfs")), "torch and CUDA need a writable cache"
    assert service["environment"]["HOME"].startswith("/tmp")


def test_the_service_exports_spans_to_jaeger(compose: dict[str, Any]) -> None:
    services = compose["services"]
    environment = services["ai-backend"]["environment"]
    assert environment["AI_SERVICE_TELEMETRY__EXPORTER"] == "otlp_grpc"
    assert environment["AI_SERVICE_TELEMETRY__ENDPOINT"] == "http://jaeger:4317"
    assert "jaeger" in services and "4317" in {str(p) for p in services["jaeger"].get("expose", [])}


def test_the_service_stops_within_compose_grace(compose: dict[str, Any]) -> None:
    grace = compose["services"]["ai-backend"].get("stop_grace_period", "10s")
    assert _seconds(grace) >= SHUTDOWN_GRACE_S + FLUSH_S, f"compose would kill the drain or the flush: {grace}"


def test_prometheus_scrapes_the_service_with_the_rules_mounted(compose: dict[str, Any]) -> None:
    services = compose["services"]
    binds = _binds(services["prometheus"])
    assert any(
        Path(src).resolve() == PROMETHEUS_DIR.resolve() and target == "/etc/prometheus" for src, target, _ in binds
    ), binds
    command = " ".join(services["prometheus"]["command"])
    assert "--config.file=/etc/prometheus/prometheus.yml" in command
    scrape = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in services, f"scrape target {target} is no compose service"
        assert port == "8000"


def test_grafana_is_provisioned_with_the_datasources_and_the_dashboard(compose: dict[str, Any]) -> None:
    services = compose["services"]
    binds = {target: Path(src).resolve() for src, target, _ in _binds(services["grafana"])}
    assert binds["/etc/grafana/provisioning"] == (GRAFANA_DIR / "provisioning").resolve()
    assert binds["/etc/grafana/dashboards"] == (GRAFANA_DIR / "dashboards").resolve()
    provider = load_yaml(GRAFANA_DIR / "provisioning" / "dashboards" / "dashboards.yml")
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    datasources = load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "datasources.yml")["datasources"]
    for datasource in datasources:
        host = re.match(r"https?://([^:/]+)", datasource["url"])
        assert host and host.group(1) in services, datasource["url"]


def test_every_bind_mount_exists_and_every_port_is_on_loopback(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for source, _, _ in _binds(service):
            if source.startswith("/"):  # named volumes have no path
                assert Path(source).exists(), f"{name}: {source} does not exist"
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port.get('published')}"
            assert published.startswith("127.0.0.1:"), f"{name}: {port} is published beyond loopback"
