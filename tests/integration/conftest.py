"""Fixtures shared by the integration tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A model repository holding digits 1 and 2 (the same weights): the lifecycle tests' own."""
    from tests.integration.test_lifecycle_api import ROOT, add_version

    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    add_version(tmp_path, "2")
    return tmp_path
