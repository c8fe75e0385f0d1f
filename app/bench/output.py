"""Where the measuring tools write their reports: tried before a run, written after it.

A run takes minutes; an ``--out`` path that cannot be written (a folder in the way, no
permission, a read-only disk) found only at the end lost the whole run in a traceback. So the
paths are tried before anything is measured, the report is printed before the files are
written, and a write that fails all the same (the disk filled meanwhile) is one line on stderr.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written, or None. Tried as the write will do it: its missing folders
    made and the file opened for appending (a file already there keeps its bytes); what the try
    made is removed again, so a run that fails later leaves nothing behind. A device or a pipe is
    only asked whether it may be written: opening a named pipe would wait for a reader, and closing
    it again would end that reader's input before the report is written."""
    missing = [folder for folder in path.parents if not folder.exists()]  # the deepest first
    if (blocking := next((f for f in path.parents if f.exists() and not f.is_dir()), None)) is not None:
        return f"{blocking} is not a directory"  # (mkdir would say "File exists")
    try:
        if path.exists() and not path.is_file() and not path.is_dir():
            return None if os.access(path, os.W_OK) else "Permission denied"
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

    Atomic where it can be: written to a file beside it and renamed over it, so that a reader (or
    a run killed while it writes, the kernel's OOM killer say) finds the old whole file or the new
    one, never half of one. A link is written through, as ``unwritable`` tried it. Written on in
    place where a rename would replace the thing instead of writing to it: a device or a pipe
    (a named one, ``/dev/stdout`` under ``| jq``), and a descriptor (``/dev/fd/3``; ``/dev/stdout``
    of a run sent to a file, after what the run printed there). In place too, as before writes
    were atomic, a file in a folder where this user may not make one (or a file mounted alone)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if _descriptor(path) or (path.exists() and not path.is_file()):
            with path.open("a") as file:
                file.write(text)
        elif not _write_beside(path.resolve(), text):
            with path.open("w") as file:
                file.write(text)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


# what a folder that refuses new files (or a file mounted alone, which cannot be renamed over) says
_NO_RENAME = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EBUSY})


def _descriptor(path: Path) -> bool:
    """Whether ``path`` leads through ``/proc/PID/fd`` (``/dev/stdout``, ``/dev/fd/N``), link by link."""
    at = path.absolute()
    for _ in range(40):  # the kernel's own bound on links followed
        folder = Path(os.path.realpath(at.parent))
        if folder.name == "fd" and folder.parts[1:2] == ("proc",):
            return True
        if not at.is_symlink():
            return False
        at = folder / os.readlink(at)  # an absolute target replaces the folder
    return False


def _write_beside(target: Path, text: str) -> bool:
    """Write ``text`` to a file beside ``target`` and rename it over ``target``; False, leaving
    nothing behind, where the folder refuses the new file or ``target`` refuses the rename."""
    temporary: Path | None = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.", delete=False) as file:
            temporary = Path(file.name)
            file.write(text)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, target)
        temporary = None
    except OSError as exc:
        if exc.errno in _NO_RENAME:
            return False
        raise
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                temporary.unlink()
    return True


def _umask() -> int:
    """The process's umask (read by setting it, and put back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
