# syntax=docker/dockerfile:1
# Build: docker build -t ai-backend:0.1.0 .
#        docker build --build-arg EXTRAS=ray -t ai-backend-ray:0.1.0 .   (with Ray Serve: deploy/k8s/overlays/ray)
# Run:   docker run -p 127.0.0.1:8000:8000 -v "$PWD/models:/srv/models:ro" ai-backend:0.1.0
# The model repository is not in the image (.dockerignore): it is mounted, read-only.

# --- build: the locked dependencies, then the project (a wheel, not a link), into /srv/.venv
FROM python:3.11.13-slim-bookworm AS build
COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never
WORKDIR /srv
# optional extras of the project, e.g. "ray" (ray[serve], at the locked version)
ARG EXTRAS=""
# dependencies first: this layer is rebuilt only when the lock changes, not the code
COPY pyproject.toml uv.lock README.md ./
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project ${EXTRAS:+--extra "$EXTRAS"}
COPY app ./app
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable ${EXTRAS:+--extra "$EXTRAS"}

# --- runtime: the same Python, the virtual environment, no build tools --------------------
FROM python:3.11.13-slim-bookworm AS runtime
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --no-create-home --home-dir /nonexistent app
WORKDIR /srv
# owned by root and only readable by the service: it cannot rewrite its own code or config
COPY --from=build /srv/.venv /srv/.venv
COPY config/default.toml ./config/default.toml
ENV PATH="/srv/.venv/bin:$PATH" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    AI_SERVICE_SERVER__HOST=0.0.0.0 \
    AI_SERVICE_MODEL__REPOSITORY=/srv/models
USER 10001:10001
EXPOSE 8000
VOLUME ["/srv/models"]
# /livez where the server (PID 1) wrote it listens, not a fixed 8000 nor the settings as they read now
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-m", "app.healthcheck"]
# SIGTERM drains: readiness turns 503, queued work finishes within server.shutdown_grace_s
STOPSIGNAL SIGTERM
CMD ["ai-backend", "serve"]
