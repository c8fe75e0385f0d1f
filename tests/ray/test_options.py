"""The builder's arguments and the deployment options they make (no cluster)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.ray.options import BuildArgs, deployment_options, gpus_per_replica, read_settings, split_args
from app.settings import CONFIG_FILE_ENV, SettingsError, load_settings


def test_dotted_arguments_override_settings_and_the_rest_size_the_deployment() -> None:
    own, overrides = split_args(
        {
            "batching.normal.window_ms": "200",
            "model.names": '["digits"]',
            "model.repository": "/srv/models",
            "num_replicas": "2",
            "num_cpus": "0.5",
        }
    )
    assert overrides == {
        "batching": {"normal": {"window_ms": "200"}},
        "model": {"names": ["digits"], "repository": "/srv/models"},
    }
    assert own.num_replicas == 2
    assert own.num_cpus == 0.5
    settings = read_settings(overrides, None)
    assert settings.batching.normal.window_ms == 200.0
    assert settings.batching.normal.max_batch == 16  # the rest of the lane comes from the file
    assert settings.model.repository == Path("/srv/models")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"no_such_knob": 1}, "no_such_knob"),
        ({"batching": 3}, "name a setting"),
        ({"num_replicas": "many"}, "num_replicas"),
    ],
)
def test_bad_arguments_are_refused_by_name(args: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        split_args(args)


def test_a_bad_setting_is_refused_with_its_name() -> None:
    _, overrides = split_args({"batching.normal.max_batch": "0"})
    with pytest.raises(SettingsError, match=r"batching\.normal\.max_batch"):
        read_settings(overrides, None)


def test_config_file_is_read_then_the_environment_is_left_as_it_was(tmp_path: Path) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text("[server]\nshutdown_grace_s = 7.5\n")
    settings = read_settings({}, toml)
    assert settings.server.shutdown_grace_s == 7.5
    import os

    assert CONFIG_FILE_ENV not in os.environ


def test_a_request_refused_by_serves_queue_is_told_when_to_retry() -> None:
    """Serve's own 503 (its router's queue full) carries no Retry-After unless configured."""
    from ray.serve.config import BackpressureConfig

    from app.errors import QueueFull
    from app.ray_app import Classifier

    options = deployment_options(BuildArgs(), load_settings(), num_gpus=0)
    deployment: Any = Classifier
    configured = deployment.options(**options).backpressure_config
    assert configured == BackpressureConfig(status_code=503, retry_after_s=QueueFull.retry_after_s)


def test_options_keep_batches_whole_and_bound_the_queue() -> None:
    settings = load_settings()
    options = deployment_options(BuildArgs(), settings, num_gpus=0)
    max_batch = settings.batching.normal.max_batch
    # Serve's default of 5 ongoing requests would cap every batch at 5
    assert options["max_ongoing_requests"] >= max(64, 4 * max_batch)
    assert 0 < options["max_queued_requests"] < 10_000
    scaling = options["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
    assert "initial_replicas" not in scaling, "raising min_replicas in the config file must be enough to scale"
    assert max_batch <= scaling["target_ongoing_requests"] < options["max_ongoing_requests"]
    assert scaling["upscale_delay_s"] < scaling["downscale_delay_s"]
    assert options["graceful_shutdown_timeout_s"] > settings.server.shutdown_grace_s
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0}
    assert "num_replicas" not in options


def test_a_fixed_replica_count_turns_autoscaling_off() -> None:
    options = deployment_options(BuildArgs(num_replicas=3), load_settings(), num_gpus=1)
    assert options["num_replicas"] == 3
    assert "autoscaling_config" not in options
    assert options["ray_actor_options"]["num_gpus"] == 1


def test_the_max_batch_sizes_max_ongoing_requests() -> None:
    settings = load_settings(batching={"normal": {"max_batch": 64, "max_queue": 1024}})
    options = deployment_options(BuildArgs(), settings, num_gpus=0)
    assert options["max_ongoing_requests"] == 256
    assert options["autoscaling_config"]["target_ongoing_requests"] == 128


def test_one_gpu_per_replica_only_where_cuda_is(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.ray.options as options

    assert gpus_per_replica(BuildArgs(), load_settings(model={"device": "cpu"})) == 0
    assert gpus_per_replica(BuildArgs(), load_settings(model={"device": "cuda"})) == 1
    assert gpus_per_replica(BuildArgs(num_gpus=0.5), load_settings()) == 0.5
    monkeypatch.setattr(options, "cuda_in_cluster", lambda: True)
    assert gpus_per_replica(BuildArgs(), load_settings()) == 1
    monkeypatch.setattr(options, "cuda_in_cluster", lambda: False)
    assert gpus_per_replica(BuildArgs(), load_settings()) == 0


def test_importing_the_ray_app_loads_no_model_and_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, app.ray_app, ray; "
        "assert 'torch' not in sys.modules and 'app.main' not in sys.modules, 'imported too much'; "
        "assert not ray.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class _Batcher:
    def __init__(self, running: bool) -> None:
        self.running = running


def _replica(ready: bool, running: bool, failed_heads: dict[str, str] | None = None) -> Any:
    runner = SimpleNamespace(model=SimpleNamespace(failed_heads=failed_heads or {}))
    service = SimpleNamespace(
        ready=ready,
        state=SimpleNamespace(value="ready" if ready else "draining"),
        models={"digits": SimpleNamespace(name="digits", batcher=_Batcher(running), runner=runner)},
    )
    return SimpleNamespace(_app=SimpleNamespace(state=SimpleNamespace(service=service)))


async def test_the_health_check_fails_when_not_ready_or_a_batcher_died() -> None:
    from app.ray_app import Classifier

    check = Classifier.func_or_class.check_health
    await check(_replica(ready=True, running=True))
    with pytest.raises(RuntimeError, match="draining"):
        await check(_replica(ready=False, running=True))
    with pytest.raises(RuntimeError, match="batcher of digits"):
        await check(_replica(ready=True, running=False))
    with pytest.raises(RuntimeError, match="not started"):
        await check(SimpleNamespace(_app=None))


async def test_the_health_check_fails_where_readyz_does_on_a_default_models_failed_head() -> None:
    """``check_health`` said it was ``/readyz``'s condition but passed a replica whose default
    model's head had failed to load, which ``/readyz`` answers 503: both now call ``not_ready``."""
    from app.api.routes.health import readyz
    from app.errors import NotReady
    from app.ray_app import Classifier

    replica = _replica(ready=True, running=True, failed_heads={"classifier": "no such file"})
    with pytest.raises(RuntimeError, match="digits cannot serve: its head failed to load"):
        await Classifier.func_or_class.check_health(replica)
    with pytest.raises(NotReady, match="digits cannot serve: its head failed to load"):
        await readyz(replica._app.state.service)


KEY = "a-deployers-api-key-0123456789"


def test_the_secrets_the_builder_reads_reach_the_replicas_as_files_or_are_required_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve run`` in a shell with the key set: the builder saw it, the replicas (the Ray node's
    environment) did not, and served the API open. A file's path is handed over (no secret); a key
    inline cannot be (Ray shows a deployment's arguments), so each replica is told to find one."""
    from app.ray.options import secrets_for_replicas

    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    monkeypatch.setenv("AI_SERVICE_SERVER__API_KEY_FILE", str(key_file))
    _, overrides = split_args({"batching.normal.window_ms": "10"})
    handed, expects = secrets_for_replicas(read_settings(overrides, None), overrides)
    assert handed == {"batching": {"normal": {"window_ms": "10"}}, "server": {"api_key_file": str(key_file)}}
    assert not expects
    monkeypatch.delenv("AI_SERVICE_SERVER__API_KEY_FILE")
    monkeypatch.setenv("AI_SERVICE_SERVER__API_KEY", KEY)
    handed, expects = secrets_for_replicas(read_settings(overrides, None), overrides)
    assert handed == overrides and expects, "no key in the arguments: each replica must find its own"
    _, given = split_args({"server.api_key": KEY})  # an argument reaches the replicas as it is
    assert secrets_for_replicas(read_settings(given, None), given) == (given, False)
    monkeypatch.delenv("AI_SERVICE_SERVER__API_KEY")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AI_SERVICE_SERVER__API_KEY_FILE", "key")  # relative to where the builder runs
    handed, _ = secrets_for_replicas(read_settings({}, None), {})
    assert handed == {"server": {"api_key_file": str(key_file)}}, "named for a replica in another directory"


@pytest.mark.parametrize("device", ["cuda:1", "cuda:3"])
def test_a_cuda_index_past_the_replicas_gpus_is_refused_when_the_application_is_built(device: str) -> None:
    """Ray shows a replica of one GPU that GPU as cuda:0: ``cuda:1`` built fine, then failed every
    replica's start with "this machine has 1 CUDA device(s)". The builder now refuses it."""
    from app.ray_app import build

    with pytest.raises(SettingsError, match=rf"model\.device={device}: Ray assigns each replica its GPU"):
        build({"model.device": device})
    build({"model.device": "cuda"})
    build({"model.device": "cuda:0"})
    build({"model.device": "cuda:1", "num_gpus": 2})  # two GPUs: cuda:0 and cuda:1 to the replica


def test_replicas_that_reserve_no_gpu_serve_on_the_cpu_where_the_device_is_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray 2.60 leaves a replica of ``num_gpus`` 0 the node's GPUs: under ``model.device=auto`` each
    such replica took ``cuda:0``, a GPU Ray had not reserved for it (and may have given another)."""
    from app.ray_app import build

    monkeypatch.delenv("AI_SERVICE_MODEL__DEVICE", raising=False)

    def device(args: dict[str, Any]) -> object:
        overrides = build(args)._bound_deployment.init_args[0]
        return overrides.get("model", {}).get("device")

    assert device({"num_gpus": 0}) == "cpu"
    assert device({"num_gpus": "0", "model.names": '["digits"]'}) == "cpu"
    assert device({"num_gpus": 1}) is None, "a reserved GPU: auto finds it"
    assert device({"num_gpus": 0, "model.device": "cuda"}) == "cuda", "named: the deployer's choice"
