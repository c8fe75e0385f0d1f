"""The Pythons the project admits are the Pythons its locked binaries have wheels for.

uv chooses the interpreter by ``requires-python``: with no upper bound, a machine whose
``python3`` is newer than torch's wheels (3.15 had none for torch 2.14.1) takes it, and both of
the README's commands fail to install. Every locked package that ships only interpreter-specific
wheels (no source, no ``abi3`` or pure wheel) must have one for each admitted minor version on
Linux x86-64, the platform the service is built for and tested on.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def admitted_minors() -> list[int]:
    """Python 3 minor versions ``requires-python`` admits: its ``>=3.A`` and ``<3.B`` bounds."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    lower = re.search(r">=\s*3\.(\d+)", spec)
    upper = re.search(r"<\s*3\.(\d+)", spec)
    assert lower is not None, spec
    assert upper is not None, f"requires-python {spec!r} has no upper bound: uv would take a Python no wheel exists for"
    return list(range(int(lower[1]), int(upper[1])))


def binary_only(package: dict[str, object]) -> list[tuple[str, str]] | None:
    """A locked package's wheels as (abi, platform) tags, where it has nothing a newer Python
    could install (no source distribution, no pure or stable-ABI wheel); None otherwise."""
    wheels = package.get("wheels")
    if "sdist" in package or not isinstance(wheels, list) or not wheels:
        return None
    tags = []
    for wheel in wheels:
        _, abi, platform = wheel["url"].rsplit("/", 1)[1].removesuffix(".whl").rsplit("-", 3)[-3:]
        if abi in ("none", "abi3"):
            return None
        tags.append((abi, platform))
    return tags


def test_requires_python_is_bounded_and_matches_the_lock() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert lock["requires-python"].replace(" ", "") == pyproject["project"]["requires-python"].replace(" ", "")


def test_every_binary_only_package_has_a_wheel_for_every_admitted_python() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    minors = admitted_minors()
    missing = []
    checked = set()
    for package in lock["package"]:
        if (tags := binary_only(package)) is None:
            continue
        checked.add(package["name"])
        for minor in minors:
            if not any(abi == f"cp3{minor}" and "linux" in plat and "x86_64" in plat for abi, plat in tags):
                missing.append(f"{package['name']} {package['version']}: no cp3{minor} manylinux x86_64 wheel")
    assert not missing, missing
    assert {"torch", "torchvision"} <= checked  # the check saw the packages it is for
