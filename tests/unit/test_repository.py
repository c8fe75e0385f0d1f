"""The model repository's listing: which folders are versions."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from app.inference.manifest import is_valid_version
from app.inference.repository import Repository
from tests.support import DIGITS_DIR


@pytest.mark.parametrize(("version", "valid"), [("1", True), ("0", True), ("120", True), ("01", False), ("007", False)])
def test_a_version_is_a_whole_number_written_plainly(version: str, valid: bool) -> None:
    assert is_valid_version(version) is valid


def test_a_version_folder_with_leading_zeros_is_not_read_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``01`` beside ``1`` sorted alike, so which was the latest (the default) depended on the
    order the file system listed them in."""
    for version in ("1", "01", "2"):
        shutil.copytree(DIGITS_DIR / "1", tmp_path / "digits" / version)
    with caplog.at_level(logging.WARNING, logger="app.inference.repository"):
        (entry,) = Repository(tmp_path).models()
    assert entry.versions == ("1", "2")
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'digits' / '01'} is not read: a version is a whole number without leading zeros"
    ]
