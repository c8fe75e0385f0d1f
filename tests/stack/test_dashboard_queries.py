"""Every query of the dashboard and the alert rules reads series the service really exports.

The real app (its real lifespan and model) serves a little traffic of every kind: normal
and urgent predictions, a bad request, a refusal. Then /metrics is scraped and every
PromQL expression in config/grafana/dashboards/ai-backend.json and config/prometheus/
alerts.yml is taken apart: each selector must name a series in the scrape, by its type
(``_total`` only for a counter, ``_bucket``/``_sum``/``_count`` only for a histogram),
each label matcher and grouping label must be one the series carries, and a range (for
``rate``) may only be taken of counters and histogram parts, never of a gauge.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.stack.conftest import GRAFANA_DIR, dashboard_queries, run_tool
from tests.stack.promql import parse
from tests.support import build_settings, running_app, sample_png

# labels Prometheus adds to every scraped series, and the series it makes itself
TARGET_LABELS = {"job", "instance"}
PROMETHEUS_SERIES = {"up": set[str]()}
# exported only on CUDA: on a CPU the scrape has their HELP/TYPE lines but no samples
CUDA_ONLY = {"ai_backend_device_memory_bytes", "ai_backend_device_memory_total_bytes"}


@dataclass
class Series:
    """A series name the scrape offers: its family's type, and the labels seen on its samples."""

    kind: str
    labels: set[str] = field(default_factory=set)
    sampled: bool = False
    counts: bool = False  # a counter or a histogram part: a range of it can be rated


def exported_series(text: str) -> dict[str, Series]:
    """Every series name ``text`` offers, derived from each family's declared type."""
    series: dict[str, Series] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, ("",)):
            series[family.name + suffix] = Series(family.type, counts=family.type in ("counter", "histogram"))
        for sample in family.samples:
            entry = series.setdefault(sample.name, Series(family.type))
            entry.labels |= set(sample.labels)
            entry.sampled = True
    return series


async def _traffic_then_scrape() -> str:
    settings = build_settings(batching={"urgent": {"window_ms": 2.0}})
    async with running_app(settings) as running:
        png = {"Content-Type": "image/png"}
        normal = [running.predict_png(sample_png(d)) for d in range(6)]
        urgent = [running.predict_png(sample_png(d), headers={"X-Urgency": "high"}) for d in range(4)]
        named = [running.predict_png(sample_png(1), path="/v1/models/digits/predict")]
        answers = await asyncio.gather(*normal, *urgent, *named)
        assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers]
        bad = await running.client.post("/predict", content=b"not an image", headers=png)
        assert bad.status_code == 400
        # a deadline shorter than the lane's window: refused at admission (would_miss_deadline)
        late = await running.predict_png(sample_png(2), headers={"X-Request-Timeout": "1"})
        assert late.status_code == 503, late.text
        await running.client.get("/healthz")
        scrape = await running.client.get("/metrics")
        assert scrape.status_code == 200
        return scrape.text


@pytest.fixture(scope="module")
def scrape() -> dict[str, Series]:
    return exported_series(asyncio.run(_traffic_then_scrape()))


def _all_queries(dashboard: dict[str, Any], alert_rules: list[dict[str, Any]]) -> dict[str, str]:
    queries = {f"dashboard {where}": expr for where, expr in dashboard_queries(dashboard).items()}
    for rule in alert_rules:
        queries[f"alert {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    return queries


def test_the_scrape_has_what_the_traffic_made(scrape: dict[str, Series]) -> None:
    """The fixture's traffic reached the metrics (else the label checks below prove little)."""
    assert scrape["ai_backend_request_duration_seconds_bucket"].labels >= {"route", "status", "lane", "le"}
    assert scrape["ai_backend_batch_size_bucket"].sampled and scrape["ai_backend_queue_depth"].sampled
    assert scrape["ai_backend_rejections_total"].sampled


def test_every_series_the_queries_read_is_exported(
    scrape: dict[str, Series], dashboard: dict[str, Any], alert_rules: list[dict[str, Any]]
) -> None:
    missing: dict[str, list[str]] = defaultdict(list)
    for where, expr in _all_queries(dashboard, alert_rules).items():
        for selector in parse(expr).selectors:
            if selector.name not in scrape and selector.name not in PROMETHEUS_SERIES:
                missing[selector.name].append(where)
    assert not missing, f"series the service does not export: {json.dumps(missing, indent=1)}"


def test_the_queries_match_and_group_by_labels_the_series_carry(
    scrape: dict[str, Series], dashboard: dict[str, Any], alert_rules: list[dict[str, Any]]
) -> None:
    wrong: list[str] = []
    for where, expr in _all_queries(dashboard, alert_rules).items():
        query = parse(expr)
        known: set[str] = set(TARGET_LABELS)
        all_sampled = True
        for selector in query.selectors:
            if selector.name in PROMETHEUS_SERIES:
                known |= PROMETHEUS_SERIES[selector.name]
                continue
            series = scrape.get(selector.name)
            if series is None or not series.sampled:  # no samples to know its labels (CUDA only)
                all_sampled = False
                continue
            known |= series.labels
            unknown = selector.labels - series.labels - TARGET_LABELS
            if unknown:
                wrong.append(f"{where}: {selector.name} has no label {sorted(unknown)}")
        if all_sampled and query.grouping - known:
            wrong.append(f"{where}: groups by {sorted(query.grouping - known)}, which no series it reads has")
    assert not wrong, "\n".join(wrong)


def test_only_counters_and_histograms_are_rated(
    scrape: dict[str, Series], dashboard: dict[str, Any], alert_rules: list[dict[str, Any]]
) -> None:
    for where, expr in _all_queries(dashboard, alert_rules).items():
        for selector in parse(expr).selectors:
            series = scrape.get(selector.name)
            if selector.ranged and series is not None:
                assert series.counts, f"{where}: a range of the gauge {selector.name}"


def test_quantiles_keep_the_bucket_label(dashboard: dict[str, Any], alert_rules: list[dict[str, Any]]) -> None:
    for where, expr in _all_queries(dashboard, alert_rules).items():
        query = parse(expr)
        if "histogram_quantile" in query.functions:
            assert "le" in query.grouping, f"{where}: histogram_quantile without `le` in its aggregation"
            assert all(s.name.endswith("_bucket") for s in query.selectors), where


def test_the_cuda_only_series_are_declared_on_a_cpu_too(scrape: dict[str, Series]) -> None:
    """Their HELP/TYPE lines are there without a GPU, so the queries on them are checked by name."""
    for name in CUDA_ONLY:
        assert name in scrape, name


def test_the_dashboard_is_wired_to_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    provisioned = (GRAFANA_DIR / "provisioning" / "datasources" / "datasources.yml").read_text()
    uids = set(re.findall(r"uid:\s*(\S+)", provisioned))
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids, panel["title"]
    titles = " ".join(p["title"].lower() for p in panels)
    for needed in ("latency", "throughput", "batch size", "queue depth", "rejections", "memory"):
        assert needed in titles, needed


def test_every_dashboard_query_is_valid_promql(promtool: str, dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool checks each query's syntax, as a recording rule (Grafana's variables filled in)."""
    rules = [
        {"record": f"dashboard_query_{index}", "expr": expr.replace("$__rate_interval", "1m")}
        for index, expr in enumerate(dashboard_queries(dashboard).values())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    result = run_tool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
