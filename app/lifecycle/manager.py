"""Model lifecycle while serving: load, unload, promote, roll back, split traffic.

One operation at a time (a lock), each ending in one atomic swap of the model's routing
snapshot; a load reads, checks and warms its version outside the lock, so that a rollback or an
unload never waits behind a slow load, and takes the lock again for its swap (a promotion that
must load its candidate's head does so outside the lock too, then checks again). Requests already
routed keep the version they started on; an unloaded version stops receiving traffic first and
then drains. Promotion is verified: the candidate's
recorded held-out accuracy, at the precision it is served in, must not fall more than
a margin below the current default's, nor fp16 below fp32 (the FP16 gate), unless forced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import torch

from app.errors import Draining, NotFound, NotReady, ServiceError, Unavailable, quoted
from app.inference.loader import ModelLoadError
from app.inference.manifest import Manifest, is_valid_version
from app.inference.repository import RepositoryError
from app.lifecycle.gates import Precision, check_promotion
from app.routing import ModelGroup
from app.service import InferenceService
from app.versions import ServedModel

log = logging.getLogger(__name__)


class Conflict(ServiceError):
    """The operation contradicts the current state (409): say what to do first."""

    status = 409
    code = "conflict"


class LifecycleManager:
    """The admin operations on a running ``InferenceService``."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        self._lock = asyncio.Lock()
        self._loading: dict[tuple[str, str], asyncio.Future[ServedModel]] = {}  # loads under way

    def loads_under_way(self) -> list[asyncio.Future[ServedModel]]:
        """The loads running now (each bounded by ``model.load_timeout_s``): a close awaits them,
        as their callers would have, for one whose caller went away."""
        return list(self._loading.values())

    def _not_serving(self) -> ServiceError:
        """Why a service that is not ready refuses: ``draining`` once a shutdown began (as every
        other call then says), else ``model_not_ready``."""
        if self._service.draining:
            return Draining("the service is shutting down")
        return NotReady(f"the service is {self._service.state.value}")

    def _group(self, name: str) -> ModelGroup[ServedModel]:
        if not self._service.ready:
            raise self._not_serving()
        group = self._service.groups.get(name)
        if group is None:
            raise NotFound(f"no model named {quoted(name)} is served", code="model_not_found")
        return group

    async def _known_versions(self, group: ModelGroup[ServedModel]) -> tuple[str, ...]:
        """Versions in the repository now (a version added since start-up counts). The versions a
        pin knows (``group.known_versions``) lose those gone from disk and not loaded, and gain
        none: a version copied in stays a 404 to a pin until it is loaded (``_load``)."""
        try:
            entries = await asyncio.to_thread(self._service.repository.models)
        except (RepositoryError, OSError) as exc:  # the volume unmounted, a folder unreadable: not a bug
            log.warning("model repository unreadable: %s", exc)
            raise Unavailable(f"the model repository cannot be read now: {exc}", code="repository_unavailable") from exc
        versions = next((e.versions for e in entries if e.name == group.name), group.known_versions)
        group.forget_missing(versions)
        return versions

    async def load(self, name: str, version: str) -> ServedModel:
        """Load (checksums, self-check, warm-up) and make ``version`` routable; the default is
        unchanged. A second call for a version being loaded gets that load's outcome."""
        async with self._lock:
            group = self._group(name)
            if version in group.routing.loaded:  # serving, though perhaps gone from disk since
                return group.routing.loaded[version]
            await self._known(group, version)
            under_way = self._loading.get((name, version))
            if under_way is None:
                under_way = self._loading[(name, version)] = asyncio.ensure_future(self._load(group, version))
                under_way.add_done_callback(lambda _: self._loading.pop((name, version), None))
        return await asyncio.shield(under_way)  # a caller that goes away does not stop the load

    async def _load(self, group: ModelGroup[ServedModel], version: str) -> ServedModel:
        name = group.name
        try:
            served = await self._service.load_version(name, version)  # outside the lock: minutes, perhaps
        except ModelLoadError as exc:
            raise Conflict(f"version {version} of {name} was refused at load: {exc}", code="model_load_failed") from exc
        async with self._lock:
            if not self._service.ready:  # the drain began while it loaded: it would never be closed
                log.warning(
                    "the load of %s/%s ended after the shutdown began: not served, released",
                    name,
                    version,
                    extra={"model": name, "version": version},
                )
                await self._service.retire(served)
                del served
                await self._service.release_unloaded()
                raise self._not_serving()
            # a policy changed while it loaded or waited for the lock never reached its batcher,
            # and a copy of the same version that drained meanwhile removed the series they share
            served.batcher.set_policy(self._service.policy)
            self._service.loader.publish(served)
            served.batcher.start()
            group.routing = group.routing.with_loaded(version, served)
            group.know(version)  # a pin to it, once it is unloaded, is told to retry (503), not 404
            self._service.rewarm.start()  # the sizes the policy brought that it lacks, warmed in the background
            log.info("loaded %s/%s", name, version, extra={"model": name, "version": version})
            return served

    async def unload(self, name: str, version: str) -> None:
        """Stop routing to ``version``, let its queued and running requests finish, release it."""
        async with self._lock:
            group = self._group(name)
            served = group.routing.loaded.get(version)
            if served is None:  # 404 if the repository has no such version; else, as for a promotion, 409
                await self._known(group, version)
                raise Conflict(f"version {version} of {name} is not loaded")
            share = group.routing.canary.get(version)
            try:
                group.routing = group.routing.without(version)
            except ValueError as exc:
                raise Conflict(str(exc)) from exc
            default = group.routing.default
        await self._service.retire(served)
        del served  # the last reference here: what it held can be collected now
        await self._service.release_unloaded()
        # its canary share went to the default with it: said, as a change of who answers is
        shed = f" (its canary share {share} went to version {default})" if share else ""
        log.info("unloaded %s/%s%s", name, version, shed, extra={"model": name, "version": version})
        # a version removed from disk before its unload is unknown from now on: pinned, a 404, not
        # a 503 telling clients to retry a version that cannot come back (until the next listing)
        with contextlib.suppress(ServiceError):
            await self._known_versions(group)

    async def promote(self, name: str, version: str, force: bool = False) -> list[str]:
        """Make ``version`` the default if it passes the gates (or ``force``); returns the waived reasons."""
        while True:
            async with self._lock:
                group = self._group(name)
                if version not in group.routing.loaded:
                    await self._known(group, version)
                    raise Conflict(f"version {version} of {name} is not loaded; load it first")
                current = group.routing.default
                if version == current:
                    return []
                candidate, default = await asyncio.gather(
                    self._manifest(group, version), self._manifest(group, current)
                )
                served = group.routing.loaded[version]
                if not _describes(candidate, served.model.manifest):
                    # its figures are another export's (or were measured with other labels or another
                    # input), and a head not loaded yet would fail its checksum
                    raise Conflict(
                        f"version {version} of {name} changed on disk since it was loaded; "
                        "unload and load it again before promoting it",
                        code="version_changed",
                    )
                if served.model.default_head in served.model.loaded_heads:
                    if not _describes(default, serving := group.routing.loaded[current].model.manifest):
                        default = serving  # re-exported on disk since: its figures are not those of what serves
                    reasons = self.gate(candidate, default, served.model.dtype)
                    if reasons and not force:
                        raise Conflict("promotion refused: " + " ".join(reasons), code="promotion_refused")
                    group.routing = group.routing.promoted(version)
                    canary = dict(group.routing.canary)  # the others' shares, kept
                    log.info(
                        "promoted %s/%s (was %s)%s%s",
                        name,
                        version,
                        current,
                        " by force" if reasons else "",
                        f"; canary still {canary}" if canary else "",
                    )
                    return reasons
            # its head not loaded yet (``model.warmup`` off): loaded outside the lock, which a
            # rollback or an unload does not wait for; the routing may change meanwhile, so every
            # check is made again once it is loaded
            await self._head_serves(served)
            del served

    async def _head_serves(self, served: ServedModel) -> None:
        """The candidate's default head, loaded now (``model.warmup`` off): one whose file changed
        on disk since its version loaded (its manifest unchanged) failed its checksum on the first
        request after the promotion, and every unpinned request with it (409 here). While another
        load holds the loader, a 503 ``model_loading``; the device failing it, a 503
        ``device_unavailable`` (``VersionLoader.load_head``)."""
        try:
            await self._service.loader.load_head(served.model)
        except ModelLoadError as exc:
            raise Conflict(
                f"version {served.version} of {served.name} cannot serve: its head does not load ({exc}); "
                "unload and load it again before promoting it",
                code="version_changed",
            ) from exc

    async def _known(self, group: ModelGroup[ServedModel], version: str) -> None:
        """404 ``version_not_found`` unless the repository has ``version``."""
        if not is_valid_version(version) or version not in await self._known_versions(group):
            raise NotFound(f"model {group.name} has no version {quoted(version)}", code="version_not_found")

    async def _manifest(self, group: ModelGroup[ServedModel], version: str) -> Manifest:
        """A loaded version's manifest as on disk now (``ai-backend eval`` records accuracy there);
        the one it was loaded with when the file cannot be read any more. One whose files are
        no longer those loaded describes another export: the caller tells it by its ``files``."""
        try:
            return await asyncio.to_thread(self._service.repository.manifest, group.name, version)
        except (OSError, ValueError) as exc:
            log.warning("manifest of %s/%s unreadable (%s): gating on the one loaded", group.name, version, exc)
            return group.routing.loaded[version].model.manifest

    def gate(self, candidate: Manifest, current: Manifest | None, dtype: torch.dtype) -> list[str]:
        """Why ``candidate``, served in ``dtype`` (fp32 once a CPU fallback serves it), may not replace ``current``."""
        settings = self._service.settings.model
        precision: Precision = "fp16" if dtype == torch.float16 else "fp32"
        return check_promotion(candidate, current, precision, settings.promotion_accuracy_margin, settings.fp16_margin)

    async def rollback(self, name: str) -> str:
        """Make the previous default the default again, in one call; returns it. Once: a
        second rollback is a 409, not the demoted version put back without the gates."""
        async with self._lock:
            group = self._group(name)
            try:
                group.routing = group.routing.rolled_back()
            except ValueError as exc:  # none since start-up, or this rollback was made already
                raise Conflict(str(exc)) from exc
            log.info("rolled %s back to version %s", name, group.routing.default)
            return group.routing.default

    async def set_canary(self, name: str, weights: Mapping[str, float]) -> None:
        """Send these shares of unpinned traffic to these loaded versions; the rest to the default."""
        async with self._lock:
            group = self._group(name)
            for version in weights:
                if version not in group.routing.loaded:
                    await self._known(group, version)  # else 409 from the routing: load it first
            try:
                group.routing = group.routing.with_canary(weights)
            except ValueError as exc:
                raise Conflict(str(exc)) from exc
            # a change of which version answers, as a promotion is: the log says when it happened
            log.info(
                "canary of %s set to %s (the rest to version %s)",
                name,
                dict(group.routing.canary) or "off",
                group.routing.default,
                extra={"model": name},
            )


def _describes(on_disk: Manifest, loaded: Manifest) -> bool:
    """Whether the manifest on disk still describes the version as it was loaded: the same files,
    labels, input and layers (its evaluation may have been recorded since: ``ai-backend eval``)."""
    return on_disk.model_dump(exclude={"evaluation"}) == loaded.model_dump(exclude={"evaluation"})
