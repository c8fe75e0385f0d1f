"""What a batch costs to run, by its size: the measure behind admission's predicted wait.

A single moving mean of batch run times is wrong whenever the sizes change. After a quiet
spell of batches of one, a burst's full batches were priced at a batch of one: on a CPU,
where a batch costs about its size times an image, requests were admitted that then expired.
So the cost is a line, ``fixed + per_image * size``, fitted to moving means of the sizes and
times seen, and kept through their means with neither part negative. Until sizes vary enough
to fit one, it is read conservatively: a batch no larger than those seen costs what they cost
(a GPU's small batches cost about as much as its full ones), and a larger one costs
proportionally more (a CPU's do).
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.2  # of each new batch in the moving means
SPREAD = 0.25  # the sizes' standard deviation, in images, below which there is no line to fit


@dataclass
class BatchCost:
    """Moving means of a lane's batch sizes and run times, and the line they give."""

    _size: float = 0.0
    _time: float = 0.0
    _size2: float = 0.0  # of size squared
    _size_time: float = 0.0  # of size times time
    seen: bool = False

    def observe(self, size: int, run_s: float) -> None:
        if not self.seen:
            self._size, self._time, self._size2, self._size_time = size, run_s, size * size, size * run_s
            self.seen = True
            return
        keep = 1.0 - WEIGHT
        self._size = keep * self._size + WEIGHT * size
        self._time = keep * self._time + WEIGHT * run_s
        self._size2 = keep * self._size2 + WEIGHT * size * size
        self._size_time = keep * self._size_time + WEIGHT * size * run_s

    @property
    def mean_s(self) -> float:
        """The moving mean of the batches' run times, whatever their sizes."""
        return self._time

    def seconds(self, size: int) -> float:
        """The estimated run time of a batch of ``size`` (0 before any was seen)."""
        if not self.seen:
            return 0.0
        variance = self._size2 - self._size * self._size
        if variance < SPREAD * SPREAD:  # one size, in effect
            return self._time * max(1.0, size / max(self._size, 1.0))
        # the line through the means, its parts never negative: at steady sizes (15 and 16 at
        # saturation) the times' jitter makes the fitted slope anything, and a slope above the
        # means' own ratio would price a full batch at several times what full batches cost
        per_image = min(max(0.0, (self._size_time - self._size * self._time) / variance), self._time / self._size)
        fixed = self._time - per_image * self._size
        return fixed + per_image * size
