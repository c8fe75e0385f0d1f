"""``ai-backend bench``: a load generator for a running service, on loopback only.

Closed loop (a fixed number of clients, each sending its next request when the last
one is answered) or open loop (Poisson arrivals at a rate, whatever the answers do).
A share of requests can ride the urgent lane. The first seconds are a warm-up and are
not counted. Every run is bounded in time and in requests, and it stops by itself.

The client shares the machine with the service, so by default it is ``--client raw``: a
minimal HTTP/1.1 client on asyncio streams with every request's bytes built up front
(``app.bench.rawhttp``), several times cheaper per request than httpx (``--client httpx``,
kept as an independent implementation to cross-check against). ``--images DIR`` cycles
through several images; ``--server-pid`` adds where the CPU went in the measured window:
the server's, the client's and everything else's, per request and in cores; and, per group of
the server's threads (event loop, decode, device), the cores each used and the cores' worth of
time it was runnable but kept waiting for one (``server_threads``, Linux schedstat).
``--server-metrics`` adds the server's own account of its event loop over the window
(``server_loop_lag``: the lag it sampled, from its ``/metrics``; ``app.bench.loadgen.scrape``).
``--api-key-file`` measures a service with ``server.api_key`` set (a URL's ``USER:PASSWORD@`` is
refused, never dropped: the run would measure a wall of 401s). ``--path`` sends the same body to
another server's route, to compare servers on one model and images. ``latency`` counts the answers;
``latency_sent`` every request sent in the window, one given up on at no less than ``--timeout``.
The client raises its soft descriptor limit to the hard one, refuses a closed loop that could need
more connections than that, and warns of an open loop that could (``app.bench.loadgen.descriptors``).

Exit status: 0; 1 when nothing answers at the URL, when no request sent in the measured window
succeeded (a run of errors is not a measurement), or when ``--out`` could not be written (the
report is printed first); 2 for arguments that are wrong or could not be bounded.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

from app.bench.loadgen.descriptors import connections_needed, out_of_descriptors_line, raise_soft_limit, too_many
from app.bench.loadgen.drive import HTTPX_OPEN_LOOP_CONNECTIONS, bench, event_loop_run
from app.bench.loadgen.senders import load_images, read_api_key
from app.bench.loadgen.summary import behind_schedule, failed_share_line
from app.bench.loadgen.target import Target, loopback_addresses, parse_url, reachable
from app.bench.output import unwritable, write_text
from app.settings import ServerSettings

# the repository's, wherever the command runs from (a rival's checkout, say)
DEFAULT_IMAGE = Path(__file__).resolve().parents[3] / "models" / "digits" / "samples" / "digit_3.png"


# what a service on its default settings accepts; one may be set to take more (server.max_timeout_ms)
MAX_DEADLINE_MS: int = ServerSettings.model_fields["max_timeout_ms"].default


def _deadline_accepted(deadline_ms: float) -> bool:
    """Whether ``deadline_ms`` can be sent (rounded to whole milliseconds): finite and at least
    one; the service answers 400 to a value under 1, to every request."""
    return math.isfinite(deadline_ms) and round(deadline_ms) >= 1


def _path_sendable(path: str) -> bool:
    """Whether ``path`` can go in a request line as it is: absolute, printable ASCII, no spaces (a
    space or a line break would end the request line and send something else)."""
    return path.startswith("/") and path.isascii() and path.isprintable() and " " not in path


def _report(report: dict[str, Any], out: Path | None, requests_cap: int | None = None) -> int:
    """Print the report (then warnings: the client fell behind its schedule, the ``--requests`` cap
    cut the window short, many requests went unanswered, figures were dropped) and write it to
    ``out``. 1 when no request in the window succeeded or the file could not be written."""
    text = json.dumps(report, indent=2)
    print(text)
    warnings = (behind_schedule(report), _cut_short(report, requests_cap), failed_share_line(report))
    for warning in (*warnings, out_of_descriptors_line(report)):
        if warning is not None:
            print(f"ai-backend bench: {warning}", file=sys.stderr)
    for name, count in report.get("ignored_figures", {}).items():
        print(
            f"ai-backend bench: warning: {count} of the {report['ok']} answers had a {name} that could not be read "
            "(dropped from the figures; the answers count as successes)",
            file=sys.stderr,
        )
    code = 0
    if report["errors"] and not report["ok"]:
        errors = ", ".join(f"{key} x{count}" for key, count in report["errors"].items())
        print(f"ai-backend bench: no request in the measured window succeeded ({errors})", file=sys.stderr)
        code = 1
    elif not report["ok"]:
        print(
            f"ai-backend bench: no request was sent in the measured window{_why_none(report, requests_cap)}",
            file=sys.stderr,
        )
        code = 1
    if out is not None and (why := write_text(out, text + "\n")) is not None:
        print(f"ai-backend bench: could not write {out}: {why}", file=sys.stderr)
        code = 1
    return code


def _cut_short(report: dict[str, Any], requests_cap: int | None) -> str | None:
    """A warning when the ``--requests`` cap, not ``--duration``, ended a run that reached its
    window: the window is shorter than asked, and a faster server gets the shorter one."""
    if report.get("ended_by") != "requests_cap" or not report.get("sent_in_window"):
        return None
    cap = "" if requests_cap is None else f" of {requests_cap}"
    asked = report.get("duration_s")
    of = "" if asked is None else f" of the {asked:g} s asked"
    return (
        f"warning: the --requests cap{cap} ended the run after {report['measured_s']:g} s{of} "
        "(raise --requests for a full window)"
    )


def _why_none(report: dict[str, Any], requests_cap: int | None) -> str:
    """Why a run sent nothing in its window, when it is known: the ``--requests`` cap was used up
    in the warm-up (the window was never reached, and "none sent" read as a service fault)."""
    if requests_cap is None or report.get("sent_with_warmup", 0) < requests_cap:
        return ""
    warmup = report.get("warmup_s")
    during = "the warm-up" if warmup is None else f"the {warmup:g} s of warm-up"
    return f": the --requests cap of {requests_cap} was used up in {during} (raise --requests or shorten --warmup)"


def _parser() -> argparse.ArgumentParser:
    """The command's arguments; ``main`` checks their bounds."""
    parser = argparse.ArgumentParser(prog="ai-backend bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a loopback URL of a running service")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--model", help="target /v1/models/NAME/predict instead of /predict")
    target.add_argument(
        "--path",
        help="target this path instead (another server's prediction route, say /classify); the body is the same "
        '{"image_base64", "top_k"} JSON, and the host stays --url\'s',
    )
    parser.add_argument("--image", default=str(DEFAULT_IMAGE), help="the image every request sends")
    parser.add_argument("--images", type=Path, help="a folder of images: request n sends the n-th, cycling")
    parser.add_argument(
        "--client", choices=("raw", "httpx"), default="raw", help="raw: precomputed HTTP/1.1 bytes (default); httpx"
    )
    parser.add_argument("--server-pid", type=int, help="also report this process's CPU use (Linux /proc)")
    parser.add_argument(
        "--server-metrics",
        action="store_true",
        help="also scrape the service's /metrics at the window's ends and report its event loop's lag",
    )
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, default=32, help="closed loop: clients in flight (default 32)")
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--urgent-fraction", type=float, default=0.0, help="share of requests with X-Urgency: high")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds, after the warm-up (max 600)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds sent but not counted")
    parser.add_argument("--requests", type=int, default=200_000, help="hard cap on requests sent")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request client timeout, seconds")
    parser.add_argument(
        "--deadline-ms", type=float, help="send X-Request-Timeout; count answers that came later than it"
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        help="a file holding the service's server.api_key: sent as Authorization: Bearer on every prediction",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    return parser


def _check_bounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (``parser.error``) for an argument out of its bounds."""
    if args.path is not None and not _path_sendable(args.path):
        parser.error(f"--path {args.path!r}: give an absolute path (/...), of printable ASCII and no spaces")
    if not 0 < args.duration <= 600 or not 0 <= args.warmup <= 600 or not 0 <= args.urgent_fraction <= 1:
        parser.error("need 0 < duration <= 600, 0 <= warmup <= 600 and 0 <= urgent-fraction <= 1")
    if args.rate is not None and not 0 < args.rate <= 100_000:
        parser.error("need 0 < rate <= 100000 arrivals a second")
    if args.concurrency < 1 or args.requests < 1 or not 0 < args.timeout <= 600:
        parser.error("need concurrency >= 1, requests >= 1 and 0 < timeout <= 600")
    if args.deadline_ms is not None and not _deadline_accepted(args.deadline_ms):
        parser.error("need a finite --deadline-ms of at least 1 (as the service's X-Request-Timeout)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        host, port = parse_url(args.url)
    except ValueError as exc:
        parser.error(f"--url {exc}")
    try:
        addresses = loopback_addresses(host)
    except ValueError as exc:
        parser.error(f"--url must point at a loopback address (127.0.0.0/8, ::1 or localhost): {exc}")
    _check_bounds(parser, args)
    if args.deadline_ms is not None and round(args.deadline_ms) > MAX_DEADLINE_MS:
        print(
            f"ai-backend bench: warning: --deadline-ms {args.deadline_ms:g} is over {MAX_DEADLINE_MS}, "
            "server.max_timeout_ms by default: a service not set to take it answers 400 to every request",
            file=sys.stderr,
        )
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}/stat").exists():
        parser.error(f"--server-pid {args.server_pid}: no such process (or no /proc)")
    if args.out is not None and (why := unwritable(args.out)) is not None:
        parser.error(f"--out {args.out}: {why}")
    # the client's own descriptors: past them its connections fail, and read as the server's errors
    pool_cap = None if args.client == "raw" or args.rate is None else HTTPX_OPEN_LOOP_CONNECTIONS
    needed = connections_needed(args.concurrency, args.rate, args.timeout, args.requests, pool_cap)
    limit = raise_soft_limit()
    args.fd_limit = None if limit == resource.RLIM_INFINITY else limit
    if (why := too_many(needed, limit)) is not None and args.rate is None:
        parser.error(f"{why}, or lower --concurrency")
    if why is not None:  # a worst case (a server that answers nothing): warned of, and told apart if it comes
        print(
            f"ai-backend bench: warning: at overload {why}, or lower --rate or --timeout; past it requests fail "
            "in the client as 0:EMFILE",
            file=sys.stderr,
        )
    try:
        images = load_images(Path(args.image), args.images)
    except OSError as exc:
        parser.error(f"{'--images' if args.images is not None else '--image'}: {exc}")
    try:  # once: a key rotated in its file during the run is not followed
        args.api_key = None if args.api_key_file is None else read_api_key(args.api_key_file)
    except ValueError as exc:
        parser.error(f"--api-key-file {exc}")
    address, why = reachable(addresses, port)
    if address is None:
        print(f"ai-backend bench: nothing answers at {args.url}: {why}", file=sys.stderr)
        return 1
    args.target = Target(host, port, address)
    return _report(event_loop_run(bench(args, images)), args.out, args.requests)
