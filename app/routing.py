"""Which loaded version of a model answers a request: pinned, canary split, or the default.

A ``Routing`` is an immutable snapshot; a model's ``ModelGroup`` swaps its whole snapshot
in one assignment, so a swap is atomic for every request. A request holds the
``ServedModel`` it was routed to until it is answered, so in-flight requests finish on the
version they started with.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from app.errors import NotFound, Unavailable, quoted

V = TypeVar("V")


class VersionNotLoaded(Unavailable):
    code = "version_not_loaded"
    retry_after_s = 5


@dataclass(frozen=True)
class Routing(Generic[V]):
    """Loaded versions, the default, the previous default (for rollback), and canary weights.

    Three rules, which the README states next to the admin commands: a promotion drops the
    promoted version's canary share (it takes the rest now), keeps the others' and makes the old
    default ``previous``, with no share; a rollback promotes ``previous`` back and clears it, so
    a second rollback is refused; an unload drops the version's share (its traffic goes to the
    default) and, when it was ``previous``, clears that too.
    """

    loaded: Mapping[str, V]
    default: str
    previous: str | None = None
    canary: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default not in self.loaded:
            raise ValueError(f"default version {self.default} is not loaded")
        for version, weight in self.canary.items():
            if version not in self.loaded or version == self.default:
                raise ValueError(f"canary version {version} must be loaded and not the default")
            if not 0 <= weight <= 1:
                raise ValueError(f"canary weight for version {version} must be within 0..1")
        if sum(self.canary.values()) > 1 + 1e-9:
            raise ValueError("canary weights add up to more than 1")

    def pick(self, draw: float) -> str:
        """The version for an unpinned request, given a uniform ``draw`` in [0, 1)."""
        cumulative = 0.0
        for version, weight in sorted(self.canary.items()):
            cumulative += weight
            if draw < cumulative:
                return version
        return self.default

    def with_loaded(self, version: str, value: V) -> Routing[V]:
        return replace(self, loaded={**self.loaded, version: value})

    def without(self, version: str) -> Routing[V]:
        if version == self.default:
            raise ValueError("the default version cannot be unloaded; promote another first")
        return replace(
            self,
            loaded={v: s for v, s in self.loaded.items() if v != version},
            previous=None if self.previous == version else self.previous,
            canary={v: w for v, w in self.canary.items() if v != version},
        )

    def promoted(self, version: str) -> Routing[V]:
        if version not in self.loaded:
            raise ValueError(f"version {version} is not loaded")
        if version == self.default:
            return self
        return replace(
            self, default=version, previous=self.default, canary={v: w for v, w in self.canary.items() if v != version}
        )

    def rolled_back(self) -> Routing[V]:
        """``previous`` serves again, ungated, and is cleared: a rollback undoes one promotion
        once. Were the demoted version kept as ``previous``, a second rollback (a retried
        request) would put it back as the default without the gates a promotion applies."""
        if self.previous is None or self.previous not in self.loaded:
            raise ValueError(
                f"there is no previous default to roll back to: version {self.default} is the default, and a "
                "rollback returns once to the default the last promotion replaced (unless it was unloaded); "
                "to change the default now, promote a version"
            )
        return replace(self.promoted(self.previous), previous=None)

    def with_canary(self, weights: Mapping[str, float]) -> Routing[V]:
        return replace(self, canary=dict(weights))


class ModelGroup(Generic[V]):
    """The versions of one model and how requests are routed among them."""

    def __init__(self, name: str, known_versions: tuple[str, ...], routing: Routing[V], rng: random.Random) -> None:
        self.name = name
        self.known_versions = known_versions  # in the repository, loaded or not
        self.routing = routing
        self._rng = rng

    def know(self, version: str) -> None:
        """``version`` was loaded: a pin to it, once it is unloaded, is a 503 ``version_not_loaded``."""
        if version not in self.known_versions:
            self.known_versions = tuple(sorted((*self.known_versions, version), key=int))

    def forget_missing(self, on_disk: Collection[str]) -> None:
        """The repository lists ``on_disk`` now: a known version gone from it, and not loaded, is
        a 404 to a pin from now on (a 503 would tell clients to retry a version that cannot come
        back). A version listed but never loaded is not added: it is a 404 until it is loaded."""
        loaded = self.routing.loaded
        self.known_versions = tuple(v for v in self.known_versions if v in on_disk or v in loaded)

    def route(self, pinned: str | None = None) -> V:
        routing = self.routing  # one snapshot for the whole decision
        if pinned is not None:
            if pinned in routing.loaded:
                return routing.loaded[pinned]
            if pinned in self.known_versions:
                raise VersionNotLoaded(f"version {pinned} of {self.name} is not loaded")
            raise NotFound(f"model {self.name} has no version {quoted(pinned)}", code="version_not_found")
        return routing.loaded[routing.pick(self._rng.random())]

    @property
    def default(self) -> V:
        return self.routing.loaded[self.routing.default]
