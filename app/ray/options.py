"""The builder's arguments, the settings they make, and the deployment options those imply.

Arguments come from ``serve run app.ray_app:build key=value ...`` (strings) or from the
``args:`` of a Serve config file (YAML values). A key whose first part names a settings
group (``server``, ``model``, ``batching``, ...) overrides that setting, dotted as in the
README's settings table: ``batching.normal.window_ms=10``, ``model.repository=/srv/models``.
The other keys size the deployment (``BuildArgs``). Settings still come from the
environment (``AI_SERVICE_*``) and the TOML file first; arguments win over both.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import QueueFull
from app.settings import CONFIG_FILE_ENV, Settings, SettingsError, load_settings

SETTINGS_GROUPS = frozenset(Settings.model_fields)
# Serve's own default is 5 ongoing requests per replica: every batch would be capped at 5.
MIN_ONGOING_REQUESTS = 64
SHUTDOWN_MARGIN_S = 10.0  # Serve's budget covers its own drain, then the service's


class BuildArgs(BaseModel):
    """What ``build`` accepts besides settings overrides."""

    model_config = ConfigDict(extra="forbid")

    config_file: Path | None = Field(default=None, description="TOML settings file (AI_SERVICE_CONFIG_FILE)")
    num_replicas: int | Literal["auto"] = Field(default="auto", description="a fixed count, or auto: autoscale")
    min_replicas: int = Field(default=1, ge=0, description="autoscaling floor")
    max_replicas: int = Field(default=4, ge=1, description="autoscaling ceiling")
    target_ongoing_requests: float | None = Field(default=None, gt=0, description="default: 2 x the max batch")
    max_ongoing_requests: int | None = Field(default=None, ge=1, description="default: 4 x the max batch, >= 64")
    max_queued_requests: int | None = Field(default=None, ge=1, description="default: 2 x max_ongoing_requests")
    num_cpus: float = Field(
        default=1.0, ge=0, description="CPUs reserved per replica; its threads planned for them rounded up, 0 for 1"
    )
    num_gpus: float | Literal["auto"] = Field(default="auto", description="auto: 1 where CUDA is, else 0")
    metrics_interval_s: float = Field(default=5.0, gt=0, description="how often replicas copy metrics to Ray")


def _value(raw: object) -> object:
    """A CLI string that holds a JSON list or object becomes one (``model.names='["digits"]'``)."""
    if isinstance(raw, str) and raw.strip().startswith(("[", "{")):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(raw)
    return raw


def split_args(args: Mapping[str, object]) -> tuple[BuildArgs, dict[str, Any]]:
    """``(deployment arguments, nested settings overrides)`` from the builder's flat arguments."""
    own: dict[str, object] = {}
    overrides: dict[str, Any] = {}
    for key, raw in args.items():
        group, _, rest = key.partition(".")
        if group not in SETTINGS_GROUPS:
            own[key] = raw
            continue
        if not rest:
            raise SettingsError(f"argument {key!r}: name a setting, e.g. {group}.<field>")
        node = overrides.setdefault(group, {})
        *parents, leaf = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _value(raw)
    try:
        return BuildArgs.model_validate(own), overrides
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SettingsError(f"invalid arguments to app.ray_app:build: {problems}") from exc


@contextlib.contextmanager
def _config_file(path: Path | None) -> Iterator[None]:
    """``AI_SERVICE_CONFIG_FILE`` set to ``path`` while settings are read, then as it was."""
    if path is None:
        yield
        return
    before = os.environ.get(CONFIG_FILE_ENV)
    os.environ[CONFIG_FILE_ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CONFIG_FILE_ENV, None)
        else:
            os.environ[CONFIG_FILE_ENV] = before


def read_settings(overrides: Mapping[str, Any], config_file: Path | None) -> Settings:
    """The settings a replica serves with: overrides, then the environment, then the file."""
    with _config_file(config_file):
        return load_settings(**overrides)


def cuda_in_cluster() -> bool:
    """Whether replicas can get a GPU: the Ray cluster's resources if connected, else this host's CUDA."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0)) >= 1
    import torch  # only here: `serve run` builds before it connects, on the machine it runs on

    return bool(torch.cuda.is_available())


def gpus_per_replica(args: BuildArgs, settings: Settings) -> float:
    """One GPU per replica where CUDA is, none elsewhere (``device_override`` then keeps the replica
    off the node's GPUs, which Ray 2.60 leaves visible to it)."""
    if args.num_gpus != "auto":
        return args.num_gpus
    device = settings.model.device
    if device == "cpu":
        return 0.0
    if device.startswith("cuda"):
        return 1.0
    return 1.0 if cuda_in_cluster() else 0.0


def device_override(settings: Settings, num_gpus: float) -> str | None:
    """The ``model.device`` replicas must serve on, where the settings would take a device Ray did
    not reserve for them: ``cpu`` for ``auto`` with no GPU asked for. Ray 2.60 leaves a replica that
    reserved no GPU the node's devices (unless ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``), so ``auto``
    found CUDA there and every such replica took ``cuda:0``, beside the replicas Ray had given it.
    None: the settings stand (``cuda`` named with ``num_gpus`` 0 is the deployer's own choice)."""
    if num_gpus <= 0 and settings.model.device == "auto":
        return "cpu"
    return None


def check_device(settings: Settings, num_gpus: float) -> None:
    """Refuse a ``model.device`` that no replica can have: Ray shows a replica only the GPUs it
    assigned it (``CUDA_VISIBLE_DEVICES``), numbered from ``cuda:0``, and picks which of the node's
    they are. ``cuda:1`` on a replica of one GPU would fail every replica's start, each with a
    message about the node's devices; said here, it fails the deploy once, naming the setting."""
    device = settings.model.device
    _, _, index = device.partition(":")
    if num_gpus <= 0 or not index:  # no GPU asked for: Ray 2.60 leaves the replica the node's devices
        return
    visible = math.ceil(num_gpus)  # a fraction of a GPU is one device to the replica
    if int(index) >= visible:
        highest = "cuda:0" if visible == 1 else f"cuda:0 to cuda:{visible - 1}"
        raise SettingsError(
            f"model.device={device}: Ray assigns each replica its GPU(s) (num_gpus={num_gpus:g}) and shows "
            f"them to it as {highest}, whichever of the node's they are: use model.device=cuda (or cuda:0)"
        )


def deployment_options(args: BuildArgs, settings: Settings, num_gpus: float) -> dict[str, Any]:
    """Options for ``Classifier.options(...)`` that keep batching alive behind Serve's router.

    ``max_ongoing_requests`` is how many requests Serve lets into one replica at a time, so
    it bounds the batch: it must hold several full batches (one running, more forming).
    Past it, Serve queues up to ``max_queued_requests`` per caller and answers 503 beyond,
    with the ``Retry-After`` of the app's own queue-full 503 (Serve sends none unless told).
    Autoscaling aims at two full batches per replica. Serve first waits for the replica's
    requests to finish (its own drain), then runs the lifespan's shutdown, which gives
    queued work ``server.shutdown_grace_s``: the timeout covers both.
    """
    max_batch = max(settings.batching.normal.max_batch, settings.batching.urgent.max_batch)
    ongoing = args.max_ongoing_requests or max(MIN_ONGOING_REQUESTS, 4 * max_batch)
    options: dict[str, Any] = {
        "max_ongoing_requests": ongoing,
        "max_queued_requests": args.max_queued_requests or 2 * ongoing,
        "backpressure_config": {"retry_after_s": float(QueueFull.retry_after_s)},
        "graceful_shutdown_wait_loop_s": 2.0,
        "graceful_shutdown_timeout_s": settings.server.shutdown_grace_s + SHUTDOWN_MARGIN_S,
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": num_gpus},
    }
    if args.num_replicas == "auto":
        options["autoscaling_config"] = {
            "min_replicas": args.min_replicas,
            "max_replicas": max(args.max_replicas, args.min_replicas, 1),
            "target_ongoing_requests": args.target_ongoing_requests or float(2 * max_batch),
            "upscale_delay_s": 10.0,
            "downscale_delay_s": 300.0,
        }
        if args.min_replicas == 0:  # scale to zero, but start with one; otherwise Serve starts min_replicas
            # (left out when not needed: a config whose min_replicas is raised past it is refused)
            options["autoscaling_config"]["initial_replicas"] = 1
    else:
        options["num_replicas"] = args.num_replicas
    return options


def secrets_for_replicas(settings: Settings, overrides: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """What the replicas need to find the secrets the builder's settings name, and no secret:
    the overrides with the files of the API key and the admin token that the builder read from
    its environment or its config file (a path is no secret; Ray shows a deployment's arguments),
    and whether an API key given inline there must be found by each replica in its own (the
    replicas read the environment of the node they run on, not of ``serve run``). A replica that
    finds no key then fails its start-up: never served open where its deployer set a key."""
    overrides = {group: dict(values) if isinstance(values, dict) else values for group, values in overrides.items()}
    server, admin = overrides.get("server", {}), overrides.get("admin", {})
    # absolute: a replica runs in the directory `ray start` ran in, not the builder's
    if settings.server.api_key_file is not None and not {"api_key", "api_key_file"} & set(server):
        overrides["server"] = {**server, "api_key_file": str(settings.server.api_key_file.absolute())}
    if settings.admin.enabled and settings.admin.token_file is not None and not {"token", "token_file"} & set(admin):
        overrides["admin"] = {**admin, "token_file": str(settings.admin.token_file.absolute())}
    inline_key = settings.server.api_key is not None and "api_key" not in server
    return overrides, inline_key
