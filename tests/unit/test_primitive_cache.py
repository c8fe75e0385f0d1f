"""oneDNN's primitive cache holds a primitive per layer and batch shape, so batches of every
size stop rebuilding them (``model.onednn_primitive_cache``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from app.inference.device import PRIMITIVE_CACHE_ENV, size_primitive_cache

# two passes over batches of six sizes through two convolutions, as a batcher runs them
PROBE = textwrap.dedent(
    """
    import sys, torch
    from app.inference.device import size_primitive_cache
    size_primitive_cache(int(sys.argv[1]))
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3)).eval()
    with torch.inference_mode():
        for _ in range(2):
            for size in range(1, 7):
                model(torch.rand(size, 3, 32, 32))
    """
)


def creations(entries: int, preset: str | None = None) -> dict[str, int]:
    """oneDNN's own account (verbose ``profile_create``) of primitives built and found in its cache."""
    env = {k: v for k, v in os.environ.items() if k != PRIMITIVE_CACHE_ENV} | {"ONEDNN_VERBOSE": "profile_create"}
    if preset is not None:
        env[PRIMITIVE_CACHE_ENV] = preset
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(entries)], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return {"miss": out.count("create:cache_miss"), "hit": out.count("create:cache_hit")}


def test_the_setting_fills_the_environment_unless_it_already_says(monkeypatch: pytest.MonkeyPatch) -> None:
    # set first, so that monkeypatch records the variable and takes off what the function sets (a
    # delenv of a variable that is not there records nothing, and 8192 stayed for the session)
    monkeypatch.setenv(PRIMITIVE_CACHE_ENV, "unset by the test")
    monkeypatch.delenv(PRIMITIVE_CACHE_ENV)
    assert size_primitive_cache(0) is None, "0 keeps oneDNN's own default"
    assert size_primitive_cache(8192) == "8192" and os.environ[PRIMITIVE_CACHE_ENV] == "8192"
    monkeypatch.setenv(PRIMITIVE_CACHE_ENV, "300")
    assert size_primitive_cache(8192) == "300", "the operator's variable wins"


def test_a_cache_that_holds_every_shape_builds_each_primitive_once() -> None:
    roomy, cramped = creations(8192), creations(8192, preset="4")  # the variable set first wins
    if roomy["miss"] + roomy["hit"] == 0:
        pytest.skip("this torch's oneDNN does not report primitive creation")
    assert roomy["hit"] >= roomy["miss"] > 0, "the second pass finds every primitive the first built"
    assert cramped["miss"] >= 2 * roomy["miss"], "with 4 entries the second pass builds them all again"
