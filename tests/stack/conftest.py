"""The observability stack's files, and the tools that check them without a container engine.

A tool the machine lacks skips its tests with the reason and the way to install it
(``.ci/run`` installs them all); nothing passes without having run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT

PROMETHEUS_DIR = REPO_ROOT / "config" / "prometheus"
GRAFANA_DIR = REPO_ROOT / "config" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "ai-backend.json"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERTS_TEST = Path(__file__).parent / "promtool" / "alerts_test.yml"
TOOL_TIMEOUT_S = 120


def find_tool(name: str, install: str) -> str:
    """The path of ``name`` (``$HADOLINT``-style override first, then ``PATH``), or skip saying how to get it."""
    path = os.environ.get(name.upper().replace("-", "_")) or shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed ({install}; .ci/run installs it)")
    return path


def run_tool(*command: str) -> subprocess.CompletedProcess[str]:
    """Run a checker in the repository root, bounded in time, output captured as text."""
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)


def load_yaml(path: Path | str, text: str | None = None) -> Any:
    """A YAML document (the file at ``path``, or ``text``); skips when PyYAML is missing."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (a dev dependency: uv sync)")
    return yaml.safe_load(text if text is not None else Path(path).read_text())


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_tool("promtool", "apt-get install prometheus")


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


@pytest.fixture(scope="session")
def alert_rules() -> list[dict[str, Any]]:
    """Every rule in config/prometheus/alerts.yml."""
    document = load_yaml(ALERTS)
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Each PromQL target of the dashboard (rows' nested panels too), by ``panel title/refId``."""
    queries: dict[str, str] = {}
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            queries[f"{panel['title']}/{target['refId']}"] = target["expr"]
    return queries
