#!/usr/bin/env bash
# The project's packages, beside torch, as wheels for a GPU machine that brings its own Python and CUDA
# torch (and cannot reach a package index): downloaded here at the versions uv.lock pins, for that
# machine's Python. Usage: scripts/gpu_wheels.sh [DIR] (default .whl; PYTHON_VERSION, default 3.12).
# There: pip install --no-index --no-deps --target /tmp/site DIR/*.whl; PYTHONPATH=/tmp/site:$PWD, then
# scripts/gpu_check.sh with PYTHON=python3 (and PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# PYTEST_ADDOPTS="-p pytest_asyncio.plugin" where the machine's own pytest plugins do not fit pytest 9).
# torch, torchvision, numpy and Pillow are the machine's own; so is everything not named below.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
names=(fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv annotated-types annotated-doc
  typing-inspection typing-extensions uvicorn httptools uvloop opentelemetry-api opentelemetry-sdk
  opentelemetry-semantic-conventions opentelemetry-instrumentation opentelemetry-instrumentation-asgi
  opentelemetry-instrumentation-fastapi opentelemetry-util-http opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
  opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common opentelemetry-proto protobuf
  googleapis-common-protos grpcio asgiref pybase64 simplejpeg wrapt pytest pluggy iniconfig pytest-asyncio
  asgi-lifespan sniffio hypothesis sortedcontainers anyio packaging py-spy)
pins=$(python3 -m uv export --frozen --no-hashes --all-groups --no-emit-project 2>/dev/null | sed 's/ *;.*//' | grep '==')
wanted=()
for name in "${names[@]}"; do
  pin=$(grep -i "^${name}==" <<<"$pins" | head -1) || { echo "not in uv.lock: $name" >&2; exit 1; }
  wanted+=("$pin")
done
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp "${platforms[@]}" -d "$dir" "${wanted[@]}"
echo "$(ls "$dir" | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1))"
