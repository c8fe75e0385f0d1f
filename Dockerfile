# syntax=docker/dockerfile:1
# Build: docker build -t ai-backend .   Run: docker run -p 8000:8000 -v "$PWD/models:/srv/models:ro" ai-backend

FROM python:3.11-slim AS build
COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never
WORKDIR /srv
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project
COPY app ./app
RUN uv sync --frozen --no-dev

FROM python:3.11-slim AS runtime
RUN groupadd --system --gid 10001 app && useradd --system --uid 10001 --gid app --no-create-home app
WORKDIR /srv
COPY --from=build --chown=app:app /srv /srv
COPY --chown=app:app config ./config
ENV PATH="/srv/.venv/bin:$PATH" \
    PYTHONUNBUFFERED=1 \
    AI_SERVICE_SERVER__HOST=0.0.0.0 \
    AI_SERVICE_MODEL__REPOSITORY=/srv/models
USER app
EXPOSE 8000
VOLUME ["/srv/models"]
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
CMD ["ai-backend", "serve"]
