"""deploy/ray/serve_config.yaml: valid for Serve's own schema, and what app.ray.config writes."""

from __future__ import annotations

import yaml
from ray.serve.schema import ServeDeploySchema

from app.ray import config
from tests.support import REPO_ROOT

CONFIG = REPO_ROOT / config.DEFAULT_OUTPUT


def test_the_config_file_validates_against_serves_schema_and_leaves_the_sizes_to_the_builder() -> None:
    """A deployments block in the file wins over what the builder decides (Serve's rule): the one
    written there froze its defaults, and num_replicas: 2 in args, or beside the builder's
    autoscaling, deployed one autoscaled replica without a word."""
    from ray.serve._private.build_app import build_app
    from ray.serve.config import AutoscalingConfig
    from ray.serve.deployment import deployment_to_schema

    from app.ray_app import build

    schema = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (application,) = schema.applications
    assert application.import_path == "app.ray_app:build"
    assert application.route_prefix == "/"
    assert not application.deployments, "the builder sizes the deployment from args and settings"
    for args, replicas in ((application.args, None), ({**application.args, "num_replicas": 2}, 2)):
        (deployment,) = build_app(build({**args, "num_gpus": 0}), name="ai-backend").deployments
        options = deployment_to_schema(deployment)
        assert options.max_ongoing_requests >= 64, "Serve's default of 5 would cap every batch at 5"
        assert options.max_queued_requests > 0
        if replicas is None:
            assert options.autoscaling_config.min_replicas == 1  # type: ignore[union-attr]
            assert options.autoscaling_config.max_replicas == 4  # type: ignore[union-attr]
        else:
            assert options.num_replicas == replicas and not isinstance(options.autoscaling_config, AutoscalingConfig)


def test_the_config_file_is_what_the_generator_writes() -> None:
    assert CONFIG.read_text() == config.render(), "run: uv run python -m app.ray.config -o deploy/ray/serve_config.yaml"


def test_the_kuberay_serve_config_is_valid_and_its_args_are_accepted() -> None:
    from app.ray.options import split_args

    ray_service = yaml.safe_load((REPO_ROOT / "deploy/k8s/overlays/ray/rayservice.yaml").read_text())
    schema = ServeDeploySchema.model_validate(yaml.safe_load(ray_service["spec"]["serveConfigV2"]))
    for application in schema.applications:
        split_args(application.args or {})
