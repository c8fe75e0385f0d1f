"""The model repository on disk: ``<root>/<name>/<version>/manifest.json`` plus files.

Names and versions are validated against strict patterns before they touch the file
system, so nothing outside the root can be reached through them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from app.inference.manifest import MANIFEST_FILE, Manifest, is_valid_name, is_valid_version

log = logging.getLogger(__name__)


class RepositoryError(ValueError):
    """The repository cannot be read as configured."""


@dataclass(frozen=True)
class ModelEntry:
    """One model in the repository and the versions it holds, oldest first."""

    name: str
    versions: tuple[str, ...]

    @property
    def latest(self) -> str:
        return self.versions[-1]


class Repository:
    """Read-only view of a model repository root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def described(self) -> str:
        """The root as messages name it: a relative one with the folder it resolved to, since that
        depends on the working directory the process was started in."""
        if self.root.is_absolute():
            return str(self.root)
        return f"{self.root} ({Path.cwd() / self.root}, relative to the working directory)"

    def models(self) -> list[ModelEntry]:
        """Every model with at least one version, by name. Blocking (reads the disk)."""
        if not self.root.is_dir():
            raise RepositoryError(f"model repository {self.described()} is not a directory")
        entries = []
        for folder in sorted(self.root.iterdir()):
            if not folder.is_dir() or not is_valid_name(folder.name):
                continue
            held = [v for v in folder.iterdir() if (v / MANIFEST_FILE).is_file()]
            for padded in (v for v in held if v.name.isdigit() and not is_valid_version(v.name)):
                log.warning("%s is not read: a version is a whole number without leading zeros", padded)
            versions = sorted((v.name for v in held if is_valid_version(v.name)), key=int)
            if versions:
                entries.append(ModelEntry(folder.name, tuple(versions)))
        return entries

    def folder(self, name: str, version: str) -> Path:
        if not is_valid_name(name) or not is_valid_version(version):
            raise RepositoryError(f"invalid model name or version: {name!r}/{version!r}")
        return self.root / name / version

    def manifest(self, name: str, version: str) -> Manifest:
        return Manifest.read(self.folder(name, version))
