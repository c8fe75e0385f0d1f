"""The README's promises that code can check: its commands, CI's use of them, its settings table."""

from __future__ import annotations

import re
from pathlib import Path

from scripts.settings_table import table

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TEST_COMMAND = "python3 -m uv run --frozen pytest"
SERVE_COMMAND = "python3 -m uv run --frozen ai-backend serve"


def test_the_readme_gives_the_two_commands() -> None:
    assert f"python3 -m pip install uv && {SERVE_COMMAND}" in README
    assert f"python3 -m pip install uv && {TEST_COMMAND}" in README


def test_ci_runs_the_readmes_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/check" in ci
    commands = [line.split("#")[0] for line in (ROOT / "scripts" / "check").read_text().splitlines()]
    assert any(TEST_COMMAND in command for command in commands)


def test_the_settings_table_matches_the_settings() -> None:
    match = re.search(r"<!-- settings-table.*?-->\n(.*?)\n<!-- /settings-table -->", README, re.S)
    assert match is not None
    assert match.group(1) == table()


def test_the_curl_sample_exists() -> None:
    for sample in re.findall(r"@(models/\S+\.png)", README):
        assert (ROOT / sample).is_file()
