"""The same model behind plain FastAPI: ``python -m app.bench.rivals fastapi --repository R ...``.

What a first model server usually is: a FastAPI route validating the JSON body with pydantic,
the decode and a forward pass of that one image in Starlette's thread pool (so the event loop
keeps serving), no batching, uvicorn with its defaults (uvloop and httptools, as installed here).
Torch keeps its own thread count unless ``--threads`` sets one. ``GET /readyz`` answers 200 once
the model is loaded and warmed.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from app.bench.rivals.classifier import Classifier, PredictBody, RivalOptions, rival_options, rival_parser


def build_app(options: RivalOptions) -> Any:
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool

    loaded: list[Classifier] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loaded.append(await run_in_threadpool(Classifier.load, options))
        yield

    app = FastAPI(lifespan=lifespan)

    def classify(body: PredictBody) -> dict[str, Any]:
        classifier = loaded[0]
        return classifier.classify([classifier.decode(body.image_base64)], [body.top_k])[0]

    @app.post("/predict")
    async def predict(body: PredictBody) -> dict[str, Any]:
        return await run_in_threadpool(classify, body)

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    options, _ = rival_options(rival_parser("python -m app.bench.rivals fastapi", __doc__.split("\n\n")[0]), argv)
    uvicorn.run(build_app(options), host=options.host, port=options.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
