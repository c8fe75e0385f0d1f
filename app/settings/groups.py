"""The setting groups: the server, the models, the batcher's lanes, the admin API, telemetry,
logging, and the ``Settings`` that holds them all, each field with its default and its rule."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from app.batching.policy import UrgentFill
from app.settings.sources import CONFIG_FILE_ENV, ENV_PREFIX, SettingsError, config_path, given_config_table

Seconds = Annotated[float, Field(gt=0, le=86_400)]  # a day: longer overflows what waits on it


MIN_CONFIG_WATCH_S = 0.1  # the shortest poll of the config file (0 turns it off)
MAX_BATCH = 4096  # the most a lane's max_batch may be (a batch span links at most this many requests)


class _Group(BaseModel):
    # no infinity or NaN: an infinite grace or export delay passed "greater than 0", then
    # overflowed where it was used (``int(inf)``, a thread's ``Event.wait``)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_not_booleans(cls, value: object, info: ValidationInfo) -> object:
        """A number is not ``true`` (TOML's, or JSON's): lax validation took it as 1."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _boolean_for_number(field.annotation, value):
            raise ValueError("must be a number, not true or false")
        return value


def _boolean_for_number(annotation: object, value: object) -> bool:
    """``value`` holds a boolean where ``annotation`` wants a number (``int``, ``float``, either
    optional, or the values of a mapping of them)."""
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        return any(_boolean_for_number(arg, value) for arg in get_args(annotation) if arg is not type(None))
    if isinstance(value, Mapping) and origin in (dict, Mapping):
        inner = get_args(annotation)[-1] if get_args(annotation) else object
        return any(_boolean_for_number(inner, item) for item in value.values())
    return isinstance(value, bool) and annotation in (int, float)


def _stripped(secret: SecretStr | None) -> SecretStr | None:
    """A secret without the whitespace around it, as one read from its file is: a variable set
    from a file or a secret store often ends in a newline, which no header can carry."""
    return None if secret is None else SecretStr(secret.get_secret_value().strip())


class ServerSettings(_Group):
    """HTTP, request limits and the preprocessing pool."""

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port")
    max_image_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=64 << 20,
        description="encoded image size limit (413 above); a JSON body may be 4/3 of it",
    )
    max_image_pixels: int = Field(
        default=16_000_000, ge=64, le=200_000_000, description="width x height limit, checked from the header (413)"
    )
    jpeg_reduced_decode: bool = Field(
        default=True,
        description="decode a JPEG larger than the model needs at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling: "
        "about half the decode's CPU at 640x480), down to 0.9 of the size the resize needs; the model's input then "
        "differs from a whole decode's (25-40 dB PSNR on real photos, enough to change a borderline top-1); false "
        "decodes every JPEG whole, as torchvision's reference preprocessing does",
    )
    default_top_k: int = Field(default=5, ge=1, description="classes returned when the request names no top_k")
    max_top_k: int = Field(default=20, ge=1, le=1000, description="largest top_k accepted (also capped by the labels)")
    default_timeout_ms: int = Field(default=30_000, ge=1, description="deadline without X-Request-Timeout")
    max_timeout_ms: int = Field(default=120_000, ge=1, description="largest X-Request-Timeout accepted")
    preprocess_workers: int = Field(default=0, ge=0, le=64, description="threads decoding images; 0: half the cores")
    decode: Literal["auto", "pool", "batch"] = Field(
        default="auto",
        description="where images are decoded: pool (threads of their own, ahead of the batch), batch (each "
        "batch's device thread decodes its images just before its forward pass, and model.device_workers=0 plans "
        "one device thread more than the cores); auto: batch on a CPU whose device threads have one torch thread "
        "each, pool elsewhere (a GPU)",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="if set (16+ characters), prediction routes need Authorization: Bearer <key> (off by default)",
    )
    api_key_file: Path | None = Field(default=None, description="file holding the prediction API key")
    shutdown_grace_s: Seconds = Field(default=30.0, description="how long queued work may drain at shutdown")
    switch_interval_ms: float = Field(
        default=0.2,
        ge=0.01,
        le=100,
        description="Python's GIL switch interval (its default is 5): how soon a device or decode thread gets it back",
    )
    wakeup_preemption: bool = Field(
        default=False,
        description="the event loop pre-empts a running batch the moment it wakes (Linux's usual scheduling); off, "
        "while no urgent request is in flight it runs as SCHED_BATCH and waits for the batch's time slice: fewer "
        "context switches and cold caches, more throughput on busy cores",
    )
    gc_freeze: bool = Field(
        default=True,
        description="once models are loaded and warm, move every live object out of the garbage collector's walks",
    )
    gc_young_threshold: int = Field(
        default=10_000,
        ge=0,
        le=1_000_000,
        description="allocations between young-generation collections (Python's default 700; 0 keeps it)",
    )
    malloc_retain_mb: int = Field(
        default=256,
        ge=0,
        le=2047,
        description="glibc: freed memory each thread's heap keeps for the next batch instead of returning it "
        "to the OS (blocks up to 32 MiB come from a heap; resident memory stays at its high-water mark); "
        "0 keeps glibc's defaults, under which device threads fault their activations in again every batch",
    )

    @field_validator("api_key")
    @classmethod
    def _key_long_enough(cls, key: SecretStr | None) -> SecretStr | None:
        key = _stripped(key)
        if key is not None and len(key.get_secret_value()) < 16:
            # an empty one (an unset variable in a compose file) must not pass for protection
            raise ValueError("server.api_key must be at least 16 characters (whitespace around it not counted)")
        return key

    @property
    def max_body_bytes(self) -> int:
        """Room for the image as base64 inside a small JSON object."""
        return (self.max_image_bytes + 2) // 3 * 4 + 4096

    @model_validator(mode="after")
    def _coherent(self) -> ServerSettings:
        if self.default_top_k > self.max_top_k:
            raise ValueError("default_top_k must be <= max_top_k")
        if self.default_timeout_ms > self.max_timeout_ms:
            raise ValueError("default_timeout_ms must be <= max_timeout_ms")
        if self.api_key is not None and self.api_key_file is not None:
            # the key would win and the file never be read: a rotation of the file would leave it in use
            raise ValueError("server.api_key and server.api_key_file are both set: set one")
        return self


class ModelSettings(_Group):
    """Which models to serve, where they live, and on what device and precision."""

    repository: Path = Field(default=Path("models"), description="model repository root")
    default: str | None = Field(default=None, description="model behind /predict; unset: the first by name")
    names: list[str] = Field(default_factory=list, description="models to load; empty loads every model")
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="auto, cpu, cuda or cuda:N; auto tries cuda:0 at start-up and serves from the CPU, with a "
        "warning, when there is none or it does not work (held by another process, full)",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto",
        description="auto (float16 on CUDA, float32 on the CPU, where the half precisions run 20-40x slower), "
        "float32, float16 or bfloat16",
    )
    load_versions: str = Field(
        default="latest",
        pattern=r"^(latest(:[1-9][0-9]{0,2})?|all)$",
        description="versions loaded per model: latest, latest:N or all (model.versions lists them per model)",
    )
    versions: dict[str, list[str]] = Field(default_factory=dict, description="per model, the exact versions to load")
    default_versions: dict[str, str] = Field(
        default_factory=dict, description="per model, the default version (else the latest loaded)"
    )
    canary: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description='per model, traffic shares of non-default versions, e.g. {"digits": {"2": 0.1}}',
    )
    promotion_accuracy_margin: float = Field(
        default=0.01, ge=0, le=1, description="promotion refused if accuracy falls more than this below the default"
    )
    fp16_margin: float = Field(
        default=0.01, ge=0, le=1, description="promotion refused if fp16 accuracy falls more than this below fp32"
    )
    eager_heads: bool = Field(default=False, description="load every head at start instead of on first use")
    load_timeout_s: Seconds = Field(
        default=30.0,
        description="a model load taking longer stops start-up (409 through the admin API, its warm-up included)",
    )
    warmup: bool = Field(
        default=True,
        description="run batches up to the max batch size before ready; without it, on CUDA, the first batch at "
        "each size holds the device about a second while its shape is set up",
    )
    pad_batches: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="auto, on or off: pad each batch to the next power of two (or the max batch), so the device sees "
        "few shapes, all warmed: auto pads on CUDA, where each new shape costs cuDNN about a second of host CPU, "
        "not on the CPU",
    )
    cpu_fallback: bool = Field(
        default=False, description="serve from the CPU in fp32 when the device keeps failing (health: degraded)"
    )
    fallback_after_failures: int = Field(
        default=3, ge=1, le=1000, description="consecutive device failures before the CPU fallback takes over"
    )
    min_free_memory_mb: int = Field(default=256, ge=0, description="/healthz fails below this device headroom")
    device_workers: int = Field(
        default=0,
        ge=0,
        le=64,
        description="threads running batches at once; 0: 1 on CUDA, 2 on a CPU of 2+ cores (cores + 1 where "
        "batches decode their images, server.decode=auto's choice on such a CPU: 3 on 2 cores)",
    )
    urgent_workers: int | None = Field(
        default=None,
        ge=0,
        le=8,
        description="device threads for urgent batches only; unset: 1 on a CPU of 2+ cores, 0 on CUDA",
    )
    normal_nice: int | None = Field(
        default=None,
        ge=0,
        le=19,
        description="OS priority offset (nice) of the threads running normal batches, where urgent-only ones exist; "
        "unset: 10, or 2 where the device threads decode (server.decode=batch)",
    )
    urgent_pause_ms: float = Field(
        default=30.0,
        ge=0,
        le=1000,
        description="while an urgent batch of urgent requests alone runs, a normal batch on another device thread "
        "waits for it between its images and before its forward pass, at most this long in all, where the device "
        "threads outnumber the cores on a CPU (as many as are beyond them), so the urgent one has a core to itself; "
        "0: never",
    )
    urgent_slice_ms: float = Field(
        default=0,
        ge=0,
        le=100,
        description="the time slice of the urgent-only device threads under Linux's fair scheduler (6.12 and "
        "later; the kernel takes 0.1-100): woken by an urgent batch, such a thread pre-empts a normal batch's "
        "thread on its core at once; 0: the kernel's default (0.1 measured no better on a quiet host)",
    )
    cores: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="the cores the thread plan is made for; 0: the process's own (its CPU affinity and its "
        "cgroup's CPU quota). A Ray replica sets it to the CPUs Ray gave it (num_cpus)",
    )
    intra_op_threads: int = Field(
        default=0,
        ge=0,
        le=256,
        description="torch threads per batch; 0: on the CPU, its cores / device_workers; on CUDA, 1 (its CPU "
        "fallback: the cores / its device threads)",
    )
    inter_op_threads: int = Field(default=0, ge=0, le=256, description="0 keeps torch's default")
    onednn_primitive_cache: int = Field(
        default=8192,
        ge=0,
        le=1_000_000,
        description="oneDNN's primitive cache on a CPU, one entry per layer and batch shape (its own default, "
        "1024, thrashes when batches come in every size); 0, or ONEDNN_PRIMITIVE_CACHE_CAPACITY set, keeps that",
    )

    @model_validator(mode="after")
    def _default_is_loaded(self) -> ModelSettings:
        if self.default is not None and self.names and self.default not in self.names:
            raise ValueError("default must be one of names when names is set")
        return self


class LaneSettings(_Group):
    """One lane of the batcher."""

    window_ms: float = Field(
        ge=0.001, le=60_000, description="a batch goes when its oldest request has waited this long"
    )
    max_batch: int = Field(ge=1, le=MAX_BATCH, description="a batch goes as soon as it holds this many")
    max_queue: int = Field(ge=1, le=1_000_000, description="requests waiting beyond this are refused (503 queue_full)")

    @model_validator(mode="after")
    def _queue_holds_a_batch(self) -> LaneSettings:
        if self.max_queue < self.max_batch:
            raise ValueError("max_queue must be >= max_batch")
        return self


_LANES: dict[str, dict[str, Any]] = {
    "normal": {"window_ms": 25.0, "max_batch": 16, "max_queue": 1024},
    "urgent": {"window_ms": 2.0, "max_batch": 16, "max_queue": 256},
}


class BatchingSettings(_Group):
    """The dual-window batcher: an urgent lane with a short window and a normal lane."""

    normal: LaneSettings = LaneSettings(**_LANES["normal"])
    urgent: LaneSettings = LaneSettings(**_LANES["urgent"])
    urgent_fill: UrgentFill = Field(
        default=UrgentFill.BACKLOG,
        description="when urgent batches take free seats from the normal queue: always, backlog (the normal "
        "requests admitted ahead, queued or decoding, make urgent_fill_backlog full batches per device thread), "
        "never; true/false mean always/never",
    )
    urgent_fill_backlog: int = Field(
        default=3,
        ge=1,
        le=64,
        description="under urgent_fill=backlog: the full normal batches per device thread that must wait (queued "
        "or decoding) before urgent batches take riders; more keeps urgent batches small until the service is "
        "further behind; while the normal lane refuses requests (overload), one is enough",
    )
    admission_headroom: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="admit when the predicted wait is at most this share of the time left (1: up to the deadline)",
    )

    @field_validator("normal", "urgent", mode="before")
    @classmethod
    def _over_the_lane_defaults(cls, value: object, info: ValidationInfo) -> object:
        # one field of a lane (AI_SERVICE_BATCHING__NORMAL__WINDOW_MS, or a file's table with
        # only window_ms) keeps the others' defaults, whichever file is read or none
        if isinstance(value, dict):
            return {**_LANES[str(info.field_name)], **value}
        return value

    @field_validator("urgent_fill", mode="before")
    @classmethod
    def _fill_from_bool(cls, value: object) -> object:
        return UrgentFill.parse(value)

    @model_validator(mode="after")
    def _urgent_is_faster(self) -> BatchingSettings:
        if self.urgent.window_ms > self.normal.window_ms:
            raise ValueError("urgent.window_ms must be <= normal.window_ms")
        return self


class AdminSettings(_Group):
    """The admin API (runtime policy; later, model lifecycle), behind a bearer token."""

    enabled: bool = Field(default=False, description="mount /admin; needs a token")
    token: SecretStr | None = Field(default=None, description="bearer token for /admin (prefer token_file)")
    token_file: Path | None = Field(default=None, description="file holding the bearer token")
    config_watch_s: float = Field(
        default=2.0,
        ge=0,
        le=86_400,
        description="poll the config file and the secrets' files this often (0: off; else at least 0.1)",
    )

    @field_validator("config_watch_s")
    @classmethod
    def _poll_not_busy(cls, seconds: float) -> float:
        # a poll stats and hashes the file: every 0.1 ms that kept most of a core busy while idle
        if 0 < seconds < MIN_CONFIG_WATCH_S:
            raise ValueError(f"admin.config_watch_s must be 0 (off) or at least {MIN_CONFIG_WATCH_S:g} s")
        return seconds

    @field_validator("token")
    @classmethod
    def _token_stripped(cls, token: SecretStr | None) -> SecretStr | None:
        return _stripped(token)

    @model_validator(mode="after")
    def _token_when_enabled(self) -> AdminSettings:
        if self.enabled and self.token is None and self.token_file is None:
            raise ValueError("admin.enabled needs admin.token or admin.token_file")
        if self.token is not None and self.token_file is not None:
            # the token would win and the file never be read: a rotation of the file would leave it in use
            raise ValueError("admin.token and admin.token_file are both set: set one")
        if self.token is not None and len(self.token.get_secret_value()) < 16:
            raise ValueError("admin.token must be at least 16 characters (whitespace around it not counted)")
        return self


class TelemetrySettings(_Group):
    """Tracing, and the event loop's lag. What these leave unset, the OTLP exporters read from
    the standard ``OTEL_EXPORTER_OTLP_*`` variables (``app.telemetry.tracing.make_exporter``):
    the endpoint and the gRPC exporter's TLS where ``endpoint`` is unset, TLS for a gRPC
    ``HOST:PORT`` where ``OTEL_EXPORTER_OTLP_[TRACES_]INSECURE`` is set, the certificates' files,
    the timeout where ``export_timeout_s`` is unset, headers and compression."""

    service_name: str = Field(default="ai-backend", description="service.name on every span")
    exporter: Literal["none", "console", "otlp_grpc", "otlp_http"] = Field(
        default="none",
        description="where spans go: none, console (stdout), otlp_grpc or otlp_http; none: no spans are made "
        "(logs keep the caller's traceparent)",
    )
    endpoint: str | None = Field(
        default=None,
        description="OTLP endpoint, http(s)://HOST[:PORT][/PATH], e.g. http://127.0.0.1:4317 (gRPC: http is "
        "plaintext, https TLS with the OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE and CLIENT_* files; HOST:PORT "
        "is plaintext unless OTEL_EXPORTER_OTLP_[TRACES_]INSECURE says otherwise) or :4318 (HTTP: /v1/traces is "
        "appended unless the path ends in it); checked at start; unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT and the exporter's own TLS variables, else its default on localhost",
    )
    sampling_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="parent-based ratio sampler (a batch span is kept when any of its requests is)",
    )

    @model_validator(mode="after")
    def _endpoint_is_a_url(self) -> TelemetrySettings:
        """``http(s)://HOST[:PORT][/PATH]`` (gRPC's exporter also takes ``HOST:PORT``): a malformed
        one started, and every span was then dropped. A query or a fragment is refused: /v1/traces
        appended after it made a URL no collector serves."""
        if self.endpoint is None:
            return self
        endpoint = self.endpoint
        bare = "://" not in endpoint and self.exporter == "otlp_grpc"
        parsed = urlsplit("//" + endpoint if bare else endpoint)
        try:
            port: int | None = parsed.port  # a port that is not a number (or out of range) raises
        except ValueError:
            port = -1
        malformed = not (bare or parsed.scheme in ("http", "https")) or not parsed.hostname or port == -1
        if malformed or "?" in endpoint or "#" in endpoint:
            form = "http(s)://HOST[:PORT][/PATH] (no query) or, for otlp_grpc, HOST:PORT"
            raise ValueError(f"telemetry.endpoint must be {form}, not {endpoint[:64]!r}")
        return self

    @model_validator(mode="after")
    def _grpc_reads_its_timeout(self) -> TelemetrySettings:
        """The gRPC exporter parses ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` itself whatever timeout
        it is given, and one that is no number stopped the start-up with its traceback: refused
        here, in one line (the HTTP exporter's is warned of and 5 s used: ``export_timeout_s``)."""
        name = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
        if self.exporter == "otlp_grpc" and (text := os.environ.get(name)) is not None:
            try:
                float(text)
            except ValueError:
                raise ValueError(
                    f"{name}={text[:64]!r} is no number (of seconds), and the gRPC exporter cannot start with it"
                ) from None
        return self

    max_queue: int = Field(default=2048, ge=1, le=1_000_000, description="spans waiting for export; more are dropped")
    batch_size: int = Field(default=256, ge=1, le=65536, description="spans per export call")
    schedule_delay_ms: float = Field(default=1000.0, gt=0, le=3_600_000, description="longest wait before an export")
    export_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="one export call's timeout, seconds; unset: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, else "
        "OTEL_EXPORTER_OTLP_TIMEOUT (seconds, as the Python exporters read them), else 5; set, it wins over them",
    )
    loop_lag_interval_ms: float = Field(
        default=250.0,
        ge=0,
        le=60_000,
        description="how often the event loop's lag is sampled into event_loop_lag_seconds; 0: not sampled",
    )
    loop_lag_warn_ms: float = Field(
        default=250.0,
        gt=0,
        le=3_600_000,
        description="a lag this long or longer is logged as a warning (one a minute at most)",
    )


class LoggingSettings(_Group):
    """Log level and format (one JSON object a line, or plain text for a terminal)."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="log level: DEBUG, INFO, WARNING or ERROR"
    )
    json_format: bool = Field(default=True, description="one JSON object a line; false: plain text")
    access_log: bool = Field(default=True, description="one line per request: method, path, status, duration")
    refusal_lines_per_s: float = Field(
        default=20.0,
        ge=0,
        le=1_000_000,
        description="access lines a second at most for the 503 answers of each code (overload makes them most "
        "requests); the rest are counted into one line a second (unlogged_503) and in the metrics as always; 0: no cap",
    )


def check_windows(batching: BatchingSettings, server: ServerSettings) -> None:
    """The rule between a batching policy and the server's deadlines (``ValueError`` if broken).

    Admission lets a request's wait (its window at the least) take ``admission_headroom`` of its
    deadline: a longer normal window would refuse every request that keeps the default deadline.
    """
    share = batching.admission_headroom
    if batching.normal.window_ms >= share * server.default_timeout_ms:
        raise ValueError(
            "batching.normal.window_ms must be < batching.admission_headroom x server.default_timeout_ms"
            f" ({share:g} x {server.default_timeout_ms:g} ms): a longer window refuses every request"
            " that keeps the default deadline"
        )


class Settings(BaseSettings):
    """Everything the service can be told. See ``app.settings`` for precedence."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    batching: BatchingSettings = BatchingSettings()
    admin: AdminSettings = AdminSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    logging: LoggingSettings = LoggingSettings()

    @model_validator(mode="after")
    def _windows_fit_in_timeouts(self) -> Settings:
        check_windows(self.batching, self.server)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        config_file = config_path()
        if CONFIG_FILE_ENV in os.environ and not os.environ[CONFIG_FILE_ENV].strip():
            raise SettingsError(f"{CONFIG_FILE_ENV} is set but empty: name a TOML file, or unset it for {config_file}")
        if CONFIG_FILE_ENV in os.environ and not config_file.is_file():
            why = "a directory, not a file" if config_file.is_dir() else "no such file"
            raise SettingsError(f"{CONFIG_FILE_ENV}={config_file}: {why}")
        given = given_config_table()  # the file as a reload read it once, checked
        file = (
            InitSettingsSource(settings_cls, given)
            if given is not None
            else TomlConfigSettingsSource(settings_cls, toml_file=config_file)
        )
        return (init_settings, env_settings, file)
