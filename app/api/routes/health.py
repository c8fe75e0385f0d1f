"""Probes: liveness, readiness and the full health report. None of them touch the model."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.api.deps import Service
from app.api.errors import error_responses
from app.api.schemas import HealthResponse, MemoryHealth, ModelHealth, Status
from app.batching import Lane
from app.errors import NotReady
from app.inference.device import dtype_name
from app.service import InferenceService

router = APIRouter(tags=["health"])


@router.get("/livez", response_model=Status, summary="The process and its event loop are alive")
async def livez() -> Status:
    return Status(status="alive")


@router.get(
    "/readyz",
    response_model=Status,
    responses=error_responses(503),
    summary="200 once every model is loaded, checked and warmed and the batchers run",
)
async def readyz(service: Service) -> Status:
    if (reason := not_ready(service)) is not None:
        raise NotReady(reason, code="not_ready")
    return Status(status="ready")


def not_ready(service: InferenceService) -> str | None:
    """Why the service cannot serve its default models, or None when it can: the condition of
    ``/readyz``, and of Serve's health check (``app.ray_app``), so that the two cannot drift."""
    if not service.ready:
        return f"the service is {service.state.value}"
    if stopped := [s.name for s in service.models.values() if not s.batcher.running]:
        return f"the batcher of {', '.join(stopped)} is not running"
    # a head loaded lazily (model.warmup off) that failed on first use: that model serves nothing
    if broken := [s.name for s in service.models.values() if s.runner.model.failed_heads]:
        return f"model {', '.join(broken)} cannot serve: its head failed to load (see /healthz)"
    return None


@router.get(
    "/healthz",
    response_model=HealthResponse,
    responses={503: {"model": HealthResponse, "description": "A check failed; the body says which"}},
    summary="Models, device, memory headroom and queue depths; 503 when a check fails",
)
async def healthz(service: Service, request: Request) -> JSONResponse:
    free = await service.memory()
    min_free = service.settings.model.min_free_memory_mb << 20
    defaults = {(s.name, s.version) for s in service.models.values()}
    models = [
        ModelHealth(
            name=s.name,
            version=s.version,
            default=(s.name, s.version) in defaults,
            device=str(s.runner.model.device),
            dtype=dtype_name(s.model.dtype),
            loaded=True,
            batcher_running=s.batcher.running,
            device_failures=s.runner.failures,
            failed_heads=_unplaced(s.runner.model.failed_heads, service.settings.model.repository),
            unreadable_heads=_unplaced(s.model.unreadable_heads, service.settings.model.repository),
            queue_depth={lane.value: s.batcher.depth(lane) for lane in Lane},
            batch_ceiling=s.batcher.ceiling,
        )
        for s in service.all_served()
    ]
    memory = MemoryHealth(
        free_bytes=free.free, total_bytes=free.total, min_free_bytes=min_free, ok=free.free >= min_free
    )
    failure_limit = service.settings.model.fallback_after_failures

    def sound(m: ModelHealth) -> bool:
        return m.batcher_running and m.device_failures < failure_limit and not m.failed_heads and not m.unreadable_heads

    # a version that is not the default failing its checks: the default traffic is served, the rest says why
    healthy = service.ready and memory.ok and bool(models) and all(sound(m) for m in models if m.default)
    degraded = service.degraded or not all(sound(m) for m in models)
    report = HealthResponse(
        status=("degraded" if degraded else "ok") if healthy else "failing",
        state=service.state.value,
        device=str(service.device),
        dtype=dtype_name(service.dtype),
        models=models,
        memory=memory,
        failure=service.failure,
        loading=service.late_loads,
    )
    if healthy:
        return JSONResponse(report.model_dump())
    request.scope["state"]["error_code"] = "unhealthy"  # the access line and the metrics say why
    return JSONResponse(report.model_dump(), status_code=503, headers={"Retry-After": str(NotReady.retry_after_s)})


# HEAD wherever GET is (RFC 9110, 9.1): balancers and uptime checks probe with it
for _path, _probe in (("/livez", livez), ("/readyz", readyz), ("/healthz", healthz)):
    router.add_api_route(_path, _probe, methods=["HEAD"], include_in_schema=False)


def _unplaced(reasons: dict[str, str], repository: Path) -> dict[str, str]:
    """Why heads failed, their files named within the model repository: the probe answers anyone,
    and the repository's place on the server's disk is no one's business there (the log has it).
    Its resolved path (a stat or two) is looked up only when a head failed, not on every probe."""
    if not reasons:
        return reasons
    roots = sorted({f"{repository}/", f"{repository.resolve()}/"}, key=len, reverse=True)
    return {head: _within(why, roots) for head, why in reasons.items()}


def _within(text: str, roots: list[str]) -> str:
    for root in roots:
        text = text.replace(root, "")
    return text
