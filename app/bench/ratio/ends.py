"""One end of a run's limit (``ai-backend limit``, measured before the service or again after it,
or in a round of its own): the rate a ratio divides by, and the CPU an image costs at that rate.
``ratio report`` and ``ratio compare`` both take an end's limit from here, so that their ratios of
the same runs agree."""

from __future__ import annotations

from typing import Any, NamedTuple

CEILINGS = ("every_core_images_per_s", "every_thread_images_per_s")
"""Runs with no serving layer that a limit may carry besides its formula: every core at once, in
processes, and in one process with a thread per core."""


class EndLimit(NamedTuple):
    """An end's limit, and the formula's figure it was taken from."""

    images_per_s: float
    cpu_ms_per_image: float  # at ``images_per_s``: the formula's, scaled where the end was raised
    formula_images_per_s: float


def end_limit(end: dict[str, Any]) -> EndLimit:
    """One end's limit in images/s: the formula's (cores / the CPU an image costs), or more where
    a pipeline with no serving layer measured in the same run served more (every core at once,
    in processes or in threads). Such a run is what the machine did then, so a formula below it
    had its costs timed in a slow stretch, and dividing by it would flatter the ratio. The CPU an
    image costs is scaled by the same factor: the formula's figure is cores / rate."""
    measured = end["limit"]
    formula = float(measured["images_per_s"])
    rate = max([formula, *(float(measured[key]) for key in CEILINGS if key in measured)])
    return EndLimit(rate, float(measured["cpu_ms_per_image"]) * formula / rate, formula)
