"""One ``Settings`` object for the whole service.

Precedence, highest first: values passed to ``Settings(...)``, environment variables
(``AI_SERVICE_`` prefix, ``__`` between nested names, e.g.
``AI_SERVICE_BATCHING__NORMAL__WINDOW_MS=10``), then the TOML file named by
``AI_SERVICE_CONFIG_FILE`` (default ``config/default.toml``), then the defaults below,
which the shipped file repeats. Every field is validated; a bad value stops start-up
with a message naming the setting and the rule.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings import SettingsError as EnvironmentValueError

from app.batching.policy import UrgentFill
from app.errors import dotted

ENV_PREFIX = "AI_SERVICE_"
CONFIG_FILE_ENV = "AI_SERVICE_CONFIG_FILE"
DEFAULT_CONFIG_FILE = Path("config/default.toml")

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
    default_top_k: int = Field(default=5, ge=1, description="classes returned when the request names no top_k")
    max_top_k: int = Field(default=20, ge=1, le=1000, description="largest top_k accepted (also capped by the labels)")
    default_timeout_ms: int = Field(default=30_000, ge=1, description="deadline without X-Request-Timeout")
    max_timeout_ms: int = Field(default=120_000, ge=1, description="largest X-Request-Timeout accepted")
    preprocess_workers: int = Field(default=0, ge=0, le=64, description="threads decoding images; 0: half the cores")
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
        return self


class ModelSettings(_Group):
    """Which models to serve, where they live, and on what device and precision."""

    repository: Path = Field(default=Path("models"), description="model repository root")
    default: str | None = Field(default=None, description="model behind /predict; unset: the first by name")
    names: list[str] = Field(default_factory=list, description="models to load; empty loads every model")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="auto, cpu, cuda or cuda:N")
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
        default=30.0, description="a model load taking longer stops start-up (409 through the admin API)"
    )
    warmup: bool = Field(default=True, description="run batches up to the max batch size before ready")
    cpu_fallback: bool = Field(
        default=False, description="serve from the CPU in fp32 when the device keeps failing (health: degraded)"
    )
    fallback_after_failures: int = Field(
        default=3, ge=1, le=1000, description="consecutive device failures before the CPU fallback takes over"
    )
    min_free_memory_mb: int = Field(default=256, ge=0, description="/healthz fails below this device headroom")
    device_workers: int = Field(
        default=0, ge=0, le=64, description="threads running batches at once; 0: 1 on CUDA, 2 on a CPU of 2+ cores"
    )
    urgent_workers: int | None = Field(
        default=None,
        ge=0,
        le=8,
        description="device threads for urgent batches only; unset: 1 on a CPU of 2+ cores, 0 on CUDA",
    )
    normal_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="OS priority offset (nice) of the threads running normal batches, where urgent-only ones exist",
    )
    intra_op_threads: int = Field(
        default=0, ge=0, le=256, description="torch threads per batch; 0: on the CPU, its cores / device_workers"
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
        description="poll the config file this often and apply batching changes (0: off; else at least 0.1)",
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
        if self.token is not None and len(self.token.get_secret_value()) < 16:
            raise ValueError("admin.token must be at least 16 characters (whitespace around it not counted)")
        return self


class TelemetrySettings(_Group):
    """Tracing. The OTLP exporters also read the standard ``OTEL_EXPORTER_OTLP_*`` variables."""

    service_name: str = Field(default="ai-backend", description="service.name on every span")
    exporter: Literal["none", "console", "otlp_grpc", "otlp_http"] = Field(
        default="none",
        description="where spans go: none, console (stdout), otlp_grpc or otlp_http; none: no spans are made "
        "(logs keep the caller's traceparent)",
    )
    endpoint: str | None = Field(
        default=None,
        description="OTLP endpoint, e.g. http://127.0.0.1:4317 (gRPC) or :4318 (HTTP); unset: "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else the exporter's default on localhost",
    )
    sampling_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="parent-based ratio sampler (a batch span is kept when any of its requests is)",
    )
    max_queue: int = Field(default=2048, ge=1, le=1_000_000, description="spans waiting for export; more are dropped")
    batch_size: int = Field(default=256, ge=1, le=65536, description="spans per export call")
    schedule_delay_ms: float = Field(default=1000.0, gt=0, le=3_600_000, description="longest wait before an export")
    export_timeout_s: float = Field(default=5.0, gt=0, le=3600, description="one export call's timeout")


class LoggingSettings(_Group):
    """Log level and format (one JSON object a line, or plain text for a terminal)."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="log level: DEBUG, INFO, WARNING or ERROR"
    )
    json_format: bool = Field(default=True, description="one JSON object a line; false: plain text")
    access_log: bool = Field(default=True, description="one line per request: method, path, status, duration")


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
    """Everything the service can be told. See the module docstring for precedence."""

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
        if CONFIG_FILE_ENV in os.environ and not config_file.is_file():
            raise SettingsError(f"{CONFIG_FILE_ENV}={config_file}: no such file")
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=config_file))


class SettingsError(ValueError):
    """A setting is invalid; the message names it, its environment variable and the rule."""


def read_secrets(settings: Settings) -> tuple[bytes | None, bytes | None]:
    """The admin token (while the admin API is on) and the API key, from their settings or
    their files. Blocking; ``SettingsError`` names the setting whose file cannot be used."""
    admin, server = settings.admin, settings.server
    token = _secret(admin.token, admin.token_file, ("admin", "token_file")) if admin.enabled else None
    return token, _secret(server.api_key, server.api_key_file, ("server", "api_key_file"))


def _secret(value: SecretStr | None, file: Path | None, where: tuple[str, str]) -> bytes | None:
    if value is not None:
        return value.get_secret_value().encode()
    if file is None:
        return None
    setting = f"{'.'.join(where)} ({env_name(where)})"
    try:
        secret = file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{setting}: {file} cannot be read: {exc}") from exc
    if len(secret) < 16:
        raise SettingsError(f"{setting}: {file} holds fewer than 16 characters")
    return secret.encode()


def env_name(location: tuple[int | str, ...]) -> str:
    """The environment variable for a setting's location, e.g. ``AI_SERVICE_MODEL__DEVICE``."""
    return ENV_PREFIX + "__".join(str(part).upper() for part in location)


def setting_location(location: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """The part of a validation error's location that names a setting: the keys and indices
    after it are inside that setting's value (``model.versions.digits.0`` is an entry of
    ``AI_SERVICE_MODEL__VERSIONS``'s JSON, not a variable of its own)."""
    model: type[BaseModel] | None = Settings
    for length, part in enumerate(location):
        if model is None:
            return location[:length]
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:  # a name the group does not have (``server.prot``): the variable that set it
            return location[: length + 1]
        annotation = field.annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return location


def _source(location: tuple[int | str, ...], overrides: Mapping[str, object]) -> str:
    """Where a refused setting came from, for its message: the variable that holds it (its own, or
    its group's JSON), or the config file when no variable of its has a say and it was not given
    in code (``serve --port``, Ray's builder arguments: then its variable's name, as before)."""
    setting = setting_location(location)
    names = [env_name(setting[:length]) for length in range(len(setting), 0, -1)]
    if held := next((name for name in names if name in os.environ), None):
        return held
    below = names[0] + "__"  # a group's own rule over values some of which are variables
    if setting[0] in overrides or any(name.startswith(below) for name in os.environ):
        return names[0]
    return f"config file {config_path()}"


def _unparsable_variables(environ: Mapping[str, str]) -> list[str]:
    """The ``AI_SERVICE_*`` variables of list or table settings whose values are not JSON
    (pydantic-settings names only the group, not the variable)."""
    found = []
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_FILE_ENV:
            continue
        model: type[BaseModel] | None = Settings
        annotation: Any = None
        for part in name[len(ENV_PREFIX) :].lower().split("__"):
            field = model.model_fields.get(part) if model is not None else None
            if field is None:
                annotation = None
                break
            annotation = field.annotation
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if annotation is None or not _is_complex(annotation):
            continue
        try:
            json.loads(value)
        except ValueError:
            found.append(name)
    return found


def _is_complex(annotation: Any) -> bool:
    """A list, tuple, set, dict or model: what pydantic-settings reads from the environment as JSON."""
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        return any(_is_complex(arg) for arg in get_args(annotation) if arg is not type(None))
    kind = origin or annotation
    return isinstance(kind, type) and (issubclass(kind, (list, tuple, set, frozenset, dict, BaseModel)))


def config_path() -> Path:
    """The config file: ``AI_SERVICE_CONFIG_FILE``, or ``config/default.toml``."""
    return Path(os.environ.get(CONFIG_FILE_ENV, DEFAULT_CONFIG_FILE))


FileStamp = tuple[int, int, int, bytes] | str | None
"""A file's identity and version: inode, size, mtime in ns and a digest of its bytes; a string:
why it cannot be read (``Permission denied``); None: absent."""


def file_stamp(path: Path) -> FileStamp:
    """Blocking. Changes when the file is edited in place or replaced (an editor's rename), and
    when two writes of the same size land within one tick of the file system's clock."""
    try:
        stat = path.stat()
        digest = hashlib.blake2b(path.read_bytes(), digest_size=16).digest()
    except (FileNotFoundError, NotADirectoryError):  # a dangling link (a ConfigMap's key removed) too
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, digest


def read_settings(server: dict[str, object] | None = None) -> Settings:
    """The settings from the environment and the config file, with the ``server`` fields given
    on the command line (``serve --host/--port``) over them. Blocking."""
    settings = load_settings()
    if server:
        settings = load_settings(server=settings.server.model_dump() | server)
    return settings


def load_settings(**overrides: object) -> Settings:
    """Build ``Settings``, turning a validation failure, or a config file that cannot be read as
    TOML (a syntax error, an editor's write half done), into one readable ``SettingsError``."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            location = tuple(part for part in error["loc"] if not isinstance(part, int) or part >= 0)
            named = dotted(location, "settings")  # an admin body's keys cut short too
            where = f"{named} ({_source(location, overrides)})" if location else named
            lines.append(f"  {where}: {error['msg']}")
        raise SettingsError("invalid settings:\n" + "\n".join(lines)) from exc
    except SettingsError:
        raise
    except EnvironmentValueError as exc:  # pydantic-settings': a variable that does not parse
        named = ", ".join(_unparsable_variables(os.environ)) or f"an {ENV_PREFIX}* variable"
        raise SettingsError(f"{named} cannot be read: lists and tables are JSON, e.g. '[\"digits\"]' ({exc})") from exc
    except (ValueError, OSError) as exc:  # tomllib.TOMLDecodeError, UnicodeDecodeError, a read error
        raise SettingsError(f"config file {config_path()} cannot be read: {exc}") from exc
