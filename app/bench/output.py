"""Where the measuring tools write their reports: tried before a run, written after it.

A run takes minutes; an ``--out`` path that cannot be written (a folder in the way, no
permission, a read-only disk) found only at the end lost the whole run in a traceback. So the
paths are tried before anything is measured, the report is printed before the files are
written, and a write that fails all the same (the disk filled meanwhile) is one line on stderr.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written, or None. Tried as the write will do it: its missing folders
    made and the file opened for appending (a file already there keeps its bytes); what the try
    made is removed again, so a run that fails later leaves nothing behind."""
    missing = [folder for folder in path.parents if not folder.exists()]  # the deepest first
    if (blocking := next((f for f in path.parents if f.exists() and not f.is_dir()), None)) is not None:
        return f"{blocking} is not a directory"  # (mkdir would say "File exists")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = path.resolve()  # a link (dangling, say) is written through: its target is what is made
        existed = target.exists()
        with path.open("a"):
            pass
        if not existed:
            target.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for folder in missing:
            with contextlib.suppress(OSError):
                folder.rmdir()
    return None


def write_text(path: Path, text: str) -> str | None:
    """Write ``text`` to ``path``, making its folder; None, or why it could not, in one line.

    Atomic: written to a file beside it and renamed over it, so that a reader (or a run killed
    while it writes, the kernel's OOM killer say) finds the old whole file or the new one, never
    half of one. A link is written through, as ``unwritable`` tried it."""
    temporary: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = path.resolve()
        with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.", delete=False) as file:
            temporary = Path(file.name)
            file.write(text)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, target)
        temporary = None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                temporary.unlink()
    return None


def _umask() -> int:
    """The process's umask (read by setting it, and put back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
