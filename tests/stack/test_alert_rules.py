"""The Prometheus config and alert rules: valid, and each alert proven on synthetic series.

``promtool test rules`` evaluates every alert in config/prometheus/alerts.yml over the
series of tests/stack/promtool/alerts_test.yml; the checks here also hold that each alert
there has both a firing and a non-firing case, and says what it means and what to check.
"""

from __future__ import annotations

from typing import Any

from tests.stack.conftest import ALERTS, ALERTS_TEST, PROMETHEUS_DIR, load_yaml, run_tool

REQUIRED_ANNOTATIONS = {"summary", "description", "first_checks"}


def test_the_prometheus_config_and_its_rule_files_are_valid(promtool: str) -> None:
    result = run_tool(promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say(promtool: str) -> None:
    result = run_tool(promtool, "test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_each_alert_says_what_it_means_and_what_to_check_first(alert_rules: list[dict[str, Any]]) -> None:
    alerts = [rule for rule in alert_rules if "alert" in rule]
    assert {rule["alert"] for rule in alerts} >= {
        "AiBackendPredictionLatencyHigh",
        "AiBackendErrorRateHigh",
        "AiBackendDeviceMemoryHigh",
        "AiBackendQueueNearBound",
    }
    for rule in alerts:
        assert set(rule["annotations"]) >= REQUIRED_ANNOTATIONS, rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule.get("for"), f"{rule['alert']} has no `for`: one bad scrape would page"
        checks = rule["annotations"]["first_checks"].splitlines()
        assert len(checks) >= 2 and all(line.strip() for line in checks), rule["alert"]


def test_each_alert_has_a_firing_and_a_quiet_case(alert_rules: list[dict[str, Any]]) -> None:
    cases = [case for test in load_yaml(ALERTS_TEST)["tests"] for case in test.get("alert_rule_test", [])]
    for rule in (rule for rule in alert_rules if "alert" in rule):
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case.get("exp_alerts") for case in mine), f"{rule['alert']}: no case where it fires"
        assert any(not case.get("exp_alerts") for case in mine), f"{rule['alert']}: no case where it stays quiet"


def test_the_documented_thresholds_are_the_rules(alert_rules: list[dict[str, Any]]) -> None:
    """The issue's thresholds: p99 > 1 s for 5 min, errors > 1% for 5 min, memory > 90% for 10 min."""
    by_name = {rule["alert"]: rule for rule in alert_rules if "alert" in rule}
    expected = {
        "AiBackendPredictionLatencyHigh": ("histogram_quantile(0.99", "> 1", "5m"),
        "AiBackendErrorRateHigh": ('status=~"5.."', "> 0.01", "5m"),
        "AiBackendDeviceMemoryHigh": ('kind="reserved"', "> 0.9", "10m"),
    }
    for name, (needle, threshold, duration) in expected.items():
        rule = by_name[name]
        expr = " ".join(rule["expr"].split())
        assert needle in expr and expr.endswith(threshold), (name, expr)
        assert rule["for"] == duration, name
    assert ALERTS.name in (PROMETHEUS_DIR / "prometheus.yml").read_text()
