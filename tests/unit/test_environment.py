"""``AI_SERVICE_*`` variables that match no setting: named in a warning, never refused."""

from __future__ import annotations

import logging

import pytest

from app.environment import unknown_variables, warn_unknown_variables
from app.settings import load_settings

# what the kubelet injects into every pod of the namespace for a Service named ai-service
# (a port named "http") and one named ai-service-admin
SERVICE_LINKS = {
    "AI_SERVICE_SERVICE_HOST": "10.96.0.12",
    "AI_SERVICE_SERVICE_PORT": "8000",
    "AI_SERVICE_SERVICE_PORT_HTTP": "8000",
    "AI_SERVICE_PORT": "tcp://10.96.0.12:8000",
    "AI_SERVICE_PORT_8000_TCP": "tcp://10.96.0.12:8000",
    "AI_SERVICE_PORT_8000_TCP_PROTO": "tcp",
    "AI_SERVICE_PORT_8000_TCP_PORT": "8000",
    "AI_SERVICE_PORT_8000_TCP_ADDR": "10.96.0.12",
    "AI_SERVICE_ADMIN_SERVICE_HOST": "10.96.0.13",
    "AI_SERVICE_ADMIN_PORT": "udp://10.96.0.13:9000",
    "AI_SERVICE_ADMIN_PORT_9000_UDP_ADDR": "10.96.0.13",
}


@pytest.mark.parametrize(
    ("variable", "named"),
    [
        ("AI_SERVICE_SERVER_PORT", "AI_SERVICE_SERVER_PORT (AI_SERVICE_SERVER__PORT?)"),
        (
            "AI_SERVICE_BATCHING_NORMAL_WINDOW_MS",
            "AI_SERVICE_BATCHING_NORMAL_WINDOW_MS (AI_SERVICE_BATCHING__NORMAL__WINDOW_MS?)",
        ),
        ("AI_SERVICE_CONFIG", "AI_SERVICE_CONFIG (AI_SERVICE_CONFIG_FILE?)"),
        ("ai_service_config_file", "ai_service_config_file (AI_SERVICE_CONFIG_FILE?)"),  # read as it is spelt
        ("AI_SERVICE_SERVERR__PORT", "AI_SERVICE_SERVERR__PORT (AI_SERVICE_SERVER__PORT?)"),
        ("AI_SERVICE_LOG_LEVEL", "AI_SERVICE_LOG_LEVEL (AI_SERVICE_LOGGING__LEVEL?)"),
        ("AI_SERVICE_FOO", "AI_SERVICE_FOO"),  # nothing close
    ],
)
def test_a_variable_that_matches_no_setting_is_named_with_the_nearest_one(variable: str, named: str) -> None:
    assert unknown_variables({variable: "1"}) == [named]


def test_what_settings_read_and_kubernetes_service_links_are_not_named() -> None:
    environ = {
        "AI_SERVICE_SERVER__PORT": "9000",
        "ai_service_logging__level": "DEBUG",  # read whatever its case
        "AI_SERVICE_BATCHING__NORMAL": '{"window_ms": 5}',
        "AI_SERVICE_CONFIG_FILE": "config/default.toml",
        "OTHER_SERVICE_HOST": "10.0.0.1",
        **SERVICE_LINKS,
    }
    assert unknown_variables(environ) == []
    # a typo that ends as a service link does is told from one by its value
    assert unknown_variables({"AI_SERVICE_SERVER_PORT": "8080"}) == [
        "AI_SERVICE_SERVER_PORT (AI_SERVICE_SERVER__PORT?)"
    ]


def test_service_links_do_not_stop_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SERVICE_LINKS.items():
        monkeypatch.setenv(name, value)
    assert load_settings().server.port == 8000


def test_one_warning_names_every_unknown_variable_and_no_value(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"AI_SERVICE_ADMIN_TOKEN": "s3cret-admin-token-0123456789", "AI_SERVICE_FOO": "bar", **SERVICE_LINKS}
    with caplog.at_level(logging.WARNING, logger="app.environment"):
        warn_unknown_variables(environ)
    (record,) = caplog.records
    assert record.getMessage() == (
        "AI_SERVICE_* variables that match no setting are ignored: "
        "AI_SERVICE_ADMIN_TOKEN (AI_SERVICE_ADMIN__TOKEN?), AI_SERVICE_FOO"
    )
    assert "s3cret" not in caplog.text and "bar" not in caplog.text
    caplog.clear()
    warn_unknown_variables(SERVICE_LINKS)
    assert caplog.records == []
