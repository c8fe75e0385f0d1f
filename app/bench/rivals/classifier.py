"""The model as every rival runs it: the service's decode and loader, its runtime tuning, warmed
at every batch size the rival can send, so that only the serving layer differs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from app.bench.limit.measure import LIMITS
from app.bench.limit.model import load_model, tune_runtime
from app.bench.loadgen.target import is_loopback
from app.inference import preprocess
from app.inference.loader import LayeredModel
from app.settings import ServerSettings

MALLOC_RETAIN_MB: int = ServerSettings.model_fields["malloc_retain_mb"].default


class PredictBody(BaseModel):
    """The JSON body ``ai-backend bench`` sends."""

    image_base64: str
    top_k: int = Field(default=5, ge=1)


@dataclass(frozen=True)
class RivalOptions:
    """What every rival is started with."""

    host: str
    port: int
    repository: Path
    model: str
    max_batch: int
    threads: int  # torch's intra-op threads a process; 0: torch's own default


def rival_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--host", default="127.0.0.1", help="a loopback address")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--repository", type=Path, required=True, help="a model repository (ai-backend export)")
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--max-batch", type=int, default=24, help="the largest batch a forward pass takes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads a process (0: torch's default)")
    return parser


def rival_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[RivalOptions, argparse.Namespace]:
    args = parser.parse_args(argv)
    if not is_loopback(f"http://{args.host}:{args.port}"):
        parser.error("--host must be a loopback address")
    if args.max_batch < 1 or args.threads < 0:
        parser.error("--max-batch must be 1 or more and --threads 0 or more")
    options = RivalOptions(args.host, args.port, args.repository, args.model, args.max_batch, args.threads)
    return options, args


class Classifier:
    """Decode a JSON body's base64 image, run batches of them, answer each image's top classes."""

    def __init__(self, model: LayeredModel, max_batch: int) -> None:
        self.model = model
        self.max_batch = max_batch
        self.labels = model.manifest.labels

    @classmethod
    def load(cls, options: RivalOptions) -> Classifier:
        """Loaded as the limit loads it, in this process (each worker process loads its own), and
        warmed at every size from 1 to ``max_batch``: the first pass at a shape pays for its plan."""
        if options.threads:
            torch.set_num_threads(options.threads)
        tune_runtime(MALLOC_RETAIN_MB)
        classifier = cls(load_model(options.repository, options.model, None), options.max_batch)
        # the service's own warm-up (LayeredModel.warm_up), at every size a batching rival can send
        classifier.model.warm_up(options.max_batch, sizes=range(1, options.max_batch + 1))
        return classifier

    def decode(self, image_base64: str) -> torch.Tensor:
        """The service's decode of a JSON body's image (``preprocess.decode_payload``)."""
        return preprocess.decode_payload(image_base64, self.model.manifest.input, LIMITS)

    def classify(self, images: Sequence[torch.Tensor], top_ks: Sequence[int]) -> list[dict[str, Any]]:
        """One answer per image, in order: its own ``top_ks[i]`` classes and the batch it ran in."""
        k = max(1, min(max(top_ks), len(self.labels)))
        with torch.inference_mode():
            probabilities, indices = self.model.probabilities(self.model.batch(images)).topk(k, dim=1)
        return [
            {
                "predictions": [
                    {"label": self.labels[i], "class_index": i, "probability": round(p, 6)}
                    for p, i in zip(row_p[:top_k], row_i[:top_k], strict=True)
                ],
                "batch_size": len(images),
            }
            for row_p, row_i, top_k in zip(probabilities.tolist(), indices.tolist(), top_ks, strict=True)
        ]
