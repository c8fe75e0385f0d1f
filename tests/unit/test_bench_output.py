"""The measuring tools' output paths: tried before a run without leaving anything behind."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from app.bench.output import unwritable, write_text

REPO = Path(__file__).resolve().parents[2]


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


# ---- where a file cannot be renamed over: written in place, as before writes were atomic --------


@pytest.mark.skipif(not Path("/dev/fd").exists(), reason="/dev/fd")
def test_a_pipe_given_as_dev_fd_is_written_to() -> None:
    """``--out /dev/stdout`` under ``| jq``: a rename beside it would go to /proc/PID/fd."""
    read, write = os.pipe()
    try:
        assert unwritable(Path(f"/dev/fd/{write}")) is None
        assert write_text(Path(f"/dev/fd/{write}"), "x\n") is None
        assert os.read(read, 100) == b"x\n"
    finally:
        os.close(read)
        os.close(write)


def test_dev_stdout_of_a_run_sent_to_a_file_gets_the_report_after_what_the_run_printed(tmp_path: Path) -> None:
    """``ai-backend bench --out /dev/stdout > run.txt``: a rename over run.txt would drop the printed text."""
    code = "from pathlib import Path; from app.bench.output import write_text; print('printed', flush=True); "
    code += "assert write_text(Path('/dev/stdout'), '{}\\n') is None"
    with (tmp_path / "run.txt").open("w") as out:
        subprocess.run([sys.executable, "-c", code], stdout=out, check=True, cwd=REPO, timeout=60)
    assert (tmp_path / "run.txt").read_text() == "printed\n{}\n"


def test_a_named_pipe_is_written_to_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert write_text(fifo, "x\n") is None
        assert os.read(reader, 100) == b"x\n" and stat.S_ISFIFO(fifo.stat().st_mode)
    finally:
        os.close(reader)


def test_trying_a_named_pipe_neither_waits_for_a_reader_nor_ends_its_input(tmp_path: Path) -> None:
    """Opened to try it, a pipe with no reader yet would hold the run back until one came, and
    closed again it would give that reader the end of its input before the report."""
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    answers: list[str | None] = []
    trying = threading.Thread(target=lambda: answers.append(unwritable(fifo)), daemon=True)
    trying.start()
    trying.join(timeout=10)
    if trying.is_alive():  # blocked opening the pipe: a reader lets it go
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        trying.join(timeout=10)
        pytest.fail("trying the pipe waited for a reader")
    assert answers == [None]


def test_a_file_in_a_folder_that_refuses_new_files_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report file made for this user in a shared folder it may not make files in (what the
    kernel answers a user other than root; root may make files anywhere, hence the stand-in)."""
    out = tmp_path / "report.json"
    out.write_text("earlier run")

    tried: list[object] = []

    def refused(*args: object, **kwargs: object) -> None:
        tried.append(kwargs.get("dir"))
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
    assert write_text(out, "{}") is None and out.read_text() == "{}"
    assert tried, "the temporary file beside it was tried first"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may make files in any folder")
def test_a_file_in_a_folder_this_user_cannot_write_is_written_in_place(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    out = folder / "report.json"
    out.write_text("earlier run")
    folder.chmod(0o555)
    try:
        assert unwritable(out) is None
        assert write_text(out, "{}") is None and out.read_text() == "{}"
        assert write_text(folder / "new.json", "{}") == "Permission denied"
    finally:
        folder.chmod(0o755)
