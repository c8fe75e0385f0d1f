"""``serve`` names the ``AI_SERVICE_*`` variables that match no setting in its log, and serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.server import spawn_digits

pytestmark = pytest.mark.e2e


def test_serve_warns_of_a_misspelt_variable_once_logging_is_set_and_still_serves(tmp_path: Path) -> None:
    server = spawn_digits(
        tmp_path,
        {
            "AI_SERVICE_MODEL_WARMUP": "secret-looking-value",  # one "_" where "__" goes
            "AI_SERVICE_PORT": "tcp://10.96.0.12:8000",  # a Kubernetes service link
            "AI_SERVICE_SERVICE_HOST": "10.96.0.12",
        },
    )
    try:
        server.wait_ready()
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]
    lines = [json.loads(line) for line in server.stderr().splitlines() if line.startswith("{")]
    warned = [line for line in lines if "match no setting" in line["message"]]
    assert [(w["level"], w["message"]) for w in warned] == [
        (
            "WARNING",
            "AI_SERVICE_* variables that match no setting are ignored: AI_SERVICE_MODEL_WARMUP "
            "(AI_SERVICE_MODEL__WARMUP?)",
        )
    ], server.stderr()[-3000:]
    assert "secret-looking-value" not in server.stderr()
