"""deploy/ray/serve_config.yaml: valid for Serve's own schema, and what app.ray.config writes."""

from __future__ import annotations

import yaml
from ray.serve.schema import ServeDeploySchema

from app.ray import config
from tests.support import REPO_ROOT

CONFIG = REPO_ROOT / config.DEFAULT_OUTPUT


def test_the_config_file_validates_against_serves_schema() -> None:
    schema = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (application,) = schema.applications
    assert application.import_path == "app.ray_app:build"
    assert application.route_prefix == "/"
    (deployment,) = application.deployments
    assert deployment.name == "Classifier"
    assert deployment.max_ongoing_requests >= 64, "Serve's default of 5 would cap every batch at 5"
    assert deployment.max_queued_requests > 0


def test_the_config_file_is_what_the_generator_writes() -> None:
    assert CONFIG.read_text() == config.render(), "run: uv run python -m app.ray.config -o deploy/ray/serve_config.yaml"


def test_the_kuberay_serve_config_is_valid_and_its_args_are_accepted() -> None:
    from app.ray.options import split_args

    ray_service = yaml.safe_load((REPO_ROOT / "deploy/k8s/overlays/ray/rayservice.yaml").read_text())
    schema = ServeDeploySchema.model_validate(yaml.safe_load(ray_service["spec"]["serveConfigV2"]))
    for application in schema.applications:
        split_args(application.args or {})
