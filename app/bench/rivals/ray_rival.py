"""The same model served by Ray Serve: ``python -m app.bench.rivals ray --repository R ...``.

Configured as Ray Serve's documentation configures a batched model behind HTTP: a
``@serve.deployment`` class with a FastAPI ingress (``@serve.ingress``) whose ``POST /predict``
route validates the JSON body and awaits a ``@serve.batch`` method, which gathers up to
``--max-batch`` requests for at most ``--batch-timeout`` seconds (the service's normal window by
default), decodes their images and runs them in one forward pass (in the batch method itself,
on the replica's event loop for user code, as Serve's examples do: what arrives meanwhile waits
for the next batch); ``--replicas`` replicas, each
an actor process that loads (and warms) the model in its constructor. Each replica asks for
cores / replicas CPUs (so that they fit on this machine's cores) and runs that many torch
threads unless ``--threads`` says otherwise. ``--max-ongoing-requests`` (Serve's
``max_ongoing_requests``, the requests one replica takes at a time) is 4 x ``--max-batch``, at
least 64, by default: Serve's default of 5 would cap every batch at 5. Serve's HTTP proxy, its
own actor, parses HTTP and passes each request to a replica; when more clients wait than the
replicas' slots hold, its router keeps offering requests that a full replica rejects, and backs
off between tries, leaving the cores idle: measure with clients <= replicas x that limit, or
raise it.

This process starts a local Ray instance of its own (``ray.init``: the machine's cores, no
dashboard, quiet logs), so GCS, raylet, the Serve controller, the proxy and the replicas are all
its descendants; then Serve's HTTP proxy on ``--host``:``--port`` and the application on ``/``.
``GET /readyz`` answers 200 once the application is RUNNING (every replica constructed, so
loaded and warmed), 503 before. SIGTERM (or Ctrl+C) shuts Serve and Ray down, kills whatever of
the Ray processes is still alive after that, and exits 0; during the start-up it lets the step
under way finish first (``ray.init``, ``serve.start`` or ``serve.run``: tens of seconds at most).
"""

# no ``from __future__ import annotations``: Serve sends the FastAPI app to each replica with
# cloudpickle, which carries a route's globals that its code uses but not those named only in
# string annotations; FastAPI in the replica could not resolve ``PredictBody`` and would take the
# body for a required query parameter (every request 422)
import asyncio
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve

from app.bench.processes import Process, descendants, end_processes
from app.bench.rivals.classifier import Classifier, PredictBody, RivalOptions, rival_options, rival_parser
from app.inference.device import cpu_cores

APPLICATION = "default"
MIN_ONGOING_REQUESTS = 64
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve's components and the replicas
EXIT_GRACE_S = 5.0  # how long Ray's processes get to exit on their own before SIGKILL


api = FastAPI()


@serve.deployment(max_ongoing_requests=MIN_ONGOING_REQUESTS)  # sized by main() with .options()
@serve.ingress(api)
class ImageClassifier:
    """One replica: the model, loaded and warmed in the constructor, behind a batch handler."""

    def __init__(self, options: RivalOptions, batch_timeout: float) -> None:
        self.classifier = Classifier.load(options)
        self.classify_batch.set_max_batch_size(options.max_batch)
        self.classify_batch.set_batch_wait_timeout_s(batch_timeout)
        self.ready = False

    @api.post("/predict")
    async def predict(self, body: PredictBody) -> dict[str, Any]:
        answer: dict[str, Any] = await self.classify_batch((body.image_base64, body.top_k))
        return answer

    @api.get("/readyz")
    async def readyz(self) -> JSONResponse:
        """200 once the application is RUNNING: every replica constructed (asked of Serve's
        controller, in a thread: the call blocks, until it first says so)."""
        if not self.ready:
            application = (await asyncio.to_thread(serve.status)).applications.get(APPLICATION)
            self.ready = application is not None and application.status == "RUNNING"  # a str enum
        return JSONResponse({"status": "ready" if self.ready else "starting"}, status_code=200 if self.ready else 503)

    @serve.batch(max_batch_size=24, batch_wait_timeout_s=0.025)  # type: ignore[untyped-decorator]  # Ray is untyped
    async def classify_batch(self, inputs: list[tuple[str, int]]) -> list[dict[str, Any]]:
        images = [self.classifier.decode(image_base64) for image_base64, _ in inputs]
        return self.classifier.classify(images, [k for _, k in inputs])


def cpus_per_replica(cores: int, replicas: int) -> float:
    """CPUs a replica asks Ray for so that ``replicas`` of them fit on ``cores``: whole CPUs
    where each gets one or more, else an equal share (Ray takes up to 4 decimals)."""
    share = cores / replicas
    return float(int(share)) if share >= 1 else int(share * 10_000) / 10_000


STOP = threading.Event()  # set by SIGTERM or SIGINT


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Only a flag: an exception raised here could land inside Ray's own calls (Cython), which
    then fail in their own way; the start-up goes on to its end, then the shutdown."""
    STOP.set()


def _start(options: RivalOptions, replicas: int, batch_timeout: float, max_ongoing: int) -> None:
    """Ray, Serve's proxy, the application; each step only if no SIGTERM came meanwhile."""
    import ray

    cores = cpu_cores()
    if not STOP.is_set():
        ray.init(
            address="local",  # a Ray of our own, never a cluster found through RAY_ADDRESS
            num_cpus=cores,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    for signum in (signal.SIGTERM, signal.SIGINT):  # ray.init puts its own SIGTERM handler (exit 15)
        signal.signal(signum, _on_signal)
    if not STOP.is_set():
        serve.start(http_options={"host": options.host, "port": options.port}, logging_config=QUIET)
    if not STOP.is_set():
        deployment: Any = ImageClassifier  # a serve.Deployment once decorated; mypy keeps seeing the class
        application = deployment.options(
            num_replicas=replicas,
            max_ongoing_requests=max_ongoing,
            ray_actor_options={"num_cpus": cpus_per_replica(cores, replicas)},
        ).bind(options, batch_timeout)
        serve.run(application, name=APPLICATION, route_prefix="/", logging_config=QUIET)
        print(f"ray rival: serving on http://{options.host}:{options.port}", file=sys.stderr, flush=True)


def _shut_down(ours: dict[Process, int]) -> None:
    """Serve, then Ray, then whatever of ``ours`` (and of this process's descendants) is left."""
    import ray

    ours = {**ours, **descendants(os.getpid())}
    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()  # also ends the processes of a ray.init that a signal interrupted
    # Ray's workers and agents are the raylet's children, orphaned once it is gone: those listed
    # while serving are ended here if shutting down left them behind
    killed = end_processes({**ours, **descendants(os.getpid())}, EXIT_GRACE_S)
    if killed:
        print(f"ray rival: killed {len(killed)} Ray processes left behind", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = rival_parser("python -m app.bench.rivals ray", __doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=1, help="Serve replicas (one process each)")
    parser.add_argument("--batch-timeout", type=float, default=0.025, help="seconds a batch waits to fill")
    parser.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=0,
        help="requests Serve lets into one replica at a time (0: 4 x --max-batch, at least 64)",
    )
    options, args = rival_options(parser, argv)
    if args.replicas < 1 or args.batch_timeout < 0 or args.max_ongoing_requests < 0:
        parser.error("--replicas must be 1 or more, --batch-timeout and --max-ongoing-requests 0 or more")
    max_ongoing = args.max_ongoing_requests or max(MIN_ONGOING_REQUESTS, 4 * options.max_batch)
    if not options.threads:
        options = RivalOptions(**{**vars(options), "threads": max(1, cpu_cores() // args.replicas)})
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)
    ours: dict[Process, int] = {}
    try:
        _start(options, args.replicas, args.batch_timeout, max_ongoing)
        ours = descendants(os.getpid())
        while not STOP.wait(1.0):
            pass
    except SystemExit as exit_:  # SIGTERM while ray.init ran: its handler's sys.exit(15)
        if exit_.code != signal.SIGTERM:
            raise
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second one must not cut the shutdown short
            signal.signal(signum, signal.SIG_IGN)
        _shut_down(ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
