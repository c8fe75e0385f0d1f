"""``python -m app.ray.config [-o deploy/ray/serve_config.yaml]``: the Serve config file.

``serve build`` writes a config for an import path that names an *application*; ours names
a *builder* (``app.ray_app:build``), so that the GPUs and the deployment's sizes are
decided where the application is deployed. This runs the steps of ``serve build`` on
``build({})`` (Serve's own ``build_app``, validated by ``ServeDeploySchema``) and writes the
builder's import path with its scaling arguments, and no ``deployments`` block: Serve lets a
config's deployment options win over what the builder decides, so a block written here froze
the sizes ``build`` computes from its arguments and settings (``num_replicas: 2`` in ``args``,
or in the block beside the builder's autoscaling, changed nothing). A block added by hand
still overrides, as Serve documents. ``tests/ray`` checks that the committed file is what this writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

IMPORT_PATH = "app.ray_app:build"
APP_NAME = "ai-backend"
DEFAULT_OUTPUT = Path("deploy/ray/serve_config.yaml")
HEADER = """\
# Ray Serve config for ai-backend, written by `python -m app.ray.config -o deploy/ray/serve_config.yaml`
# (the steps of `serve build`, for the builder app.ray_app:build, on Ray {version}).
# Deploy: ray start --head && serve deploy deploy/ray/serve_config.yaml   (docs/ray.md)
# Scale: in args, num_replicas: N (a fixed count) or auto with min_replicas and max_replicas, then
# serve deploy again. args also take settings overrides (model.repository: /srv/models,
# batching.normal.max_batch: 32, ...) and the builder's own (num_cpus, num_gpus, config_file,
# max_ongoing_requests, ...; app/ray/options.py). A deployments: block added here overrides what
# the builder decides from them (Serve's rule).
"""


def serve_config() -> dict[str, Any]:
    """The config as a dict, validated against Serve's schema."""
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from app.ray_app import build

    args = {"num_replicas": "auto", "min_replicas": 1, "max_replicas": 4}
    built = build_app(build({**args, "num_gpus": 0}), name=APP_NAME)  # the builder takes them
    assert [deployment.name for deployment in built.deployments] == ["Classifier"]
    application = ServeApplicationSchema(
        name=APP_NAME, route_prefix="/", import_path=IMPORT_PATH, args=args
    ).model_dump(exclude_unset=True)
    config = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "127.0.0.1", "port": 8000, "request_timeout_s": 125},
        "applications": [application],
    }
    ServeDeploySchema.model_validate(config)
    return config


def render() -> str:
    """The file's text: the header, then the config as YAML."""
    import ray
    import yaml  # type: ignore[import-untyped]  # a dependency of Ray's; no stubs installed

    body: str = yaml.safe_dump(serve_config(), sort_keys=False, default_flow_style=False, width=100)
    return HEADER.format(version=ray.__version__) + "\n" + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.ray.config", description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=None, help="write here instead of stdout")
    args = parser.parse_args(argv)
    text = render()
    if args.output is None:
        print(text, end="")
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
