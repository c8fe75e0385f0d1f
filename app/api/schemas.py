"""Request and response bodies, as the OpenAPI document shows them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PredictRequest(BaseModel):
    """A JSON prediction request: one image, base64-encoded (standard alphabet, padded)."""

    model_config = ConfigDict(extra="forbid")

    image_base64: str = Field(min_length=1, description="JPEG, PNG or WebP bytes, base64-encoded")
    # no upper bound here: it is min(server.max_top_k, the model's classes), known once the model is,
    # and one bound said once ("at most 10 for this model") beats a schema's 1000 followed by it.
    # The document's default is server.default_top_k as configured (app.api.openapi), not None.
    # Strict: JSON Schema's integer takes 3.0 (a number whose fraction is zero), which no schema
    # can refuse, so the description says it; a generated client sends an integer as 3.
    top_k: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description="how many classes to return: 1 to min(server.max_top_k, the model's classes); absent or "
        "null, server.default_top_k (the default here), or every class of a model with fewer. A JSON integer "
        'written without a fraction or an exponent: 3.0 or 3e0 is a 422, as are true and "3"',
    )


class PredictionItem(BaseModel):
    label: str
    class_index: int
    probability: float


class Timings(BaseModel):
    """Where the time went, in milliseconds."""

    preprocess: float = Field(description="reading the body and checking the image, and decoding it")
    queue: float = Field(description="waiting for its batch to form and go to the device")
    inference: float = Field(
        description="its batch's run, without its own decode (where a batch decodes its images, "
        "its batchmates' decodes are part of it)"
    )
    total: float = Field(description="from the request's first byte to its answer")


class PredictResponse(BaseModel):
    request_id: str
    model: str
    version: str
    predictions: list[PredictionItem]
    lane: Literal["urgent", "normal"]
    batch_size: int = Field(description="how many requests rode in the same batch")
    timings: Timings


class ErrorDetail(BaseModel):
    """One way a query parameter or an admin body did not match its schema (a 422)."""

    loc: list[str | int] = Field(description="where: the body's or the query's path to the value")
    msg: str
    type: str = Field(description="pydantic's error type, e.g. missing, int_parsing, extra_forbidden")


class ErrorResponse(BaseModel):
    """The one error envelope."""

    code: str = Field(description="stable, machine-readable error code")
    message: str
    request_id: str | None
    details: list[ErrorDetail] | None = Field(default=None, description="a 422's mismatches, at most ten")


class ModelVersion(BaseModel):
    name: str
    versions: list[str] = Field(description="every version in the repository")
    loaded_version: str | None = Field(description="the default version, which unpinned traffic gets")
    loaded_versions: list[str] = Field(default=[], description="versions loaded and routable")
    previous_version: str | None = Field(default=None, description="what a rollback returns to")
    canary: dict[str, float] = Field(default={}, description="traffic shares of non-default versions")
    state: Literal["loaded", "not_loaded"]
    default: bool = Field(description="this model answers /predict")
    labels: int | None = None
    device: str | None = None
    dtype: str | None = None
    heads_loaded: list[str] = []


class ModelsResponse(BaseModel):
    default: str | None
    models: list[ModelVersion]


class Status(BaseModel):
    status: str


class ModelHealth(BaseModel):
    name: str
    version: str
    default: bool = Field(description="the version unpinned requests go to; the others are canaries or pinned only")
    device: str = Field(description="where it runs now: the configured device, or cpu after a fallback")
    dtype: str = Field(description="the precision it runs in now: float32 after a CPU fallback")
    loaded: bool
    batcher_running: bool
    device_failures: int = Field(description="consecutive batches the device failed; the check fails at the limit")
    failed_heads: dict[str, str] = Field(
        description="heads that could not load or run on first use, and why; the check fails while any is listed"
    )
    unreadable_heads: dict[str, str] = Field(
        default={},
        description="heads whose files could not be read at their last try (tried again on their next use), and "
        "why; the check fails while any is listed",
    )
    queue_depth: dict[str, int]
    batch_ceiling: int | None = Field(
        default=None,
        description="the cap on batch sizes since the device ran out of memory (it doubles back after "
        "batches run at it without failing); null: none, the policy's own sizes",
    )


class MemoryHealth(BaseModel):
    free_bytes: int
    total_bytes: int
    min_free_bytes: int
    ok: bool


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded", "failing"] = Field(
        description="failing (503): not ready, short of memory, or a default version fails its checks; degraded: "
        "serving, but some version is served from a CPU fallback after its device kept failing, or a version that "
        "is not the default fails its checks"
    )
    state: str
    device: str = Field(description="the configured device; each model says where it runs now")
    dtype: str = Field(description="the configured precision; each model says the one it runs in now")
    models: list[ModelHealth]
    memory: MemoryHealth
    failure: str | None = None
    loading: list[str] = Field(
        default=[],
        description="model loads past model.load_timeout_s still running on the loader thread; other loads wait",
    )
