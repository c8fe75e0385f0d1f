"""The measuring tools' output paths: tried before a run without leaving anything behind."""

from __future__ import annotations

from pathlib import Path

from app.bench.output import unwritable, write_text


def test_a_path_that_can_be_written_is_tried_and_left_as_it_was(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "report.json"
    assert unwritable(deep) is None
    assert not (tmp_path / "a").exists(), "the folders made for the try are removed again"
    kept = tmp_path / "kept.json"
    kept.write_text("earlier run")
    assert unwritable(kept) is None and kept.read_text() == "earlier run"


def test_a_path_that_cannot_be_written_says_why(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert unwritable(tmp_path) is not None, "a folder"
    assert unwritable(tmp_path / "file" / "report.json") is not None, "under a file"
    assert write_text(tmp_path / "file" / "report.json", "{}") is not None
    assert write_text(tmp_path / "new" / "report.json", "{}") is None
    assert (tmp_path / "new" / "report.json").read_text() == "{}"


def test_trying_a_link_whose_target_is_not_there_leaves_both_as_they_were(tmp_path: Path) -> None:
    """A dangling ``latest.json -> runs/today.json``: the try made the target and then removed the
    link, and the later write left a plain file where the link was."""
    (tmp_path / "runs").mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to("runs/today.json")
    assert unwritable(link) is None
    assert link.is_symlink() and not (tmp_path / "runs" / "today.json").exists()
