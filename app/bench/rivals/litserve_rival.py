"""The same model served by LitServe: ``python -m app.bench.rivals litserve --repository R ...``.

Configured as LitServe's documentation configures a batched image classifier on a CPU: the
``LitAPI`` hooks (``decode_request``, ``batch``, ``predict``, ``unbatch``, ``encode_response``), a
batch of up to ``--max-batch`` images gathered for at most ``--batch-timeout`` seconds (the
service's normal window by default), ``--workers`` inference processes and as many API server
processes (LitServe's default), torch threads a worker = cores / workers unless ``--threads``
says otherwise. LitServe runs a batch's hooks in order in its worker, so each worker decodes
its batch's images and then runs them; the API servers parse the JSON and pass the body on.
``GET /health`` answers 200 once every worker has loaded (and warmed) the model.
"""

# no ``from __future__ import annotations``: LitServe reads ``decode_request``'s annotation as a type
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import litserve
import torch

from app.bench.rivals.classifier import Classifier, PredictBody, RivalOptions, rival_options, rival_parser
from app.inference.device import cpu_cores


class ImageClassifierAPI(litserve.LitAPI):  # type: ignore[misc]  # LitServe is untyped
    """The hooks LitServe calls in each worker process (spawned: this class and its options are
    pickled over to it)."""

    def __init__(self, options: RivalOptions, batch_timeout: float) -> None:
        super().__init__(max_batch_size=options.max_batch, batch_timeout=batch_timeout)
        self.options = options

    def setup(self, device: str) -> None:
        self.classifier = Classifier.load(self.options)

    def decode_request(self, request: PredictBody) -> tuple[torch.Tensor, int]:
        return self.classifier.decode(request.image_base64), request.top_k

    def batch(self, inputs: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
        return inputs  # ``predict`` stacks the images as the model lays them out

    def predict(self, inputs: list[tuple[torch.Tensor, int]]) -> list[dict[str, Any]]:
        return self.classifier.classify([image for image, _ in inputs], [k for _, k in inputs])

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output


def _on_sigterm(main_pid: int) -> Callable[[int, FrameType | None], None]:
    """SIGTERM as Ctrl+C in LitServe's main process; in the API servers it forks (which inherit
    the handler), the end uvicorn passes the signal on to once it has stopped."""

    def handle(signum: int, frame: FrameType | None) -> None:
        if os.getpid() == main_pid:
            raise KeyboardInterrupt
        raise SystemExit(0)

    return handle


def main(argv: list[str] | None = None) -> int:
    parser = rival_parser("python -m app.bench.rivals litserve", __doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1, help="inference worker processes")
    parser.add_argument("--batch-timeout", type=float, default=0.025, help="seconds a batch waits to fill")
    parser.add_argument("--fast-queue", action="store_true", help="LitServe's ZeroMQ queues")
    parser.add_argument("--api-servers", type=int, default=0, help="HTTP server processes (0: one a worker)")
    options, args = rival_options(parser, argv)
    if args.workers < 1 or args.batch_timeout < 0 or args.api_servers < 0:
        parser.error("--workers must be 1 or more, --batch-timeout and --api-servers 0 or more")
    if not options.threads:
        options = RivalOptions(**{**vars(options), "threads": max(1, cpu_cores() // args.workers)})
    server = litserve.LitServer(
        ImageClassifierAPI(options, args.batch_timeout),
        accelerator="cpu",
        workers_per_device=args.workers,
        fast_queue=args.fast_queue,
    )
    # LitServe 0.2.19 shuts its workers and API servers down on KeyboardInterrupt only: on SIGTERM
    # its main process dies and leaves them running (still bound to the port)
    signal.signal(signal.SIGTERM, _on_sigterm(os.getpid()))
    server.run(
        host=options.host,
        port=options.port,
        num_api_servers=args.api_servers or None,
        log_level="warning",
        generate_client_file=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
