"""The ``ai-backend`` command: ``serve``, and the tools ``export``, ``train-digits``, ``bench``,
``sweep``, ``limit``, ``core``, ``floor`` and ``eval``."""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from app.server import DrainingServer

log = logging.getLogger("app.cli")

EXIT_START_FAILED = 1
EXIT_BAD_SETTINGS = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


@dataclass
class _Logs:
    """How ``serve`` says what ends it early: ``logging.json_format`` once the settings are read
    (None before), and whether the log's handler is set."""

    json_format: bool | None = None
    ready: bool = False


class _StoppedEarly(Exception):
    """SIGTERM (or SIGQUIT) came before the server was up (torch importing, say): nothing to drain yet."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.name = signal.Signals(signum).name


def _stop_early(signum: int, frame: object) -> None:
    raise _StoppedEarly(signum)


def _port(text: str) -> int:
    """``--port``, checked by the parser as ``server.port`` is (0: any free port): a refusal from
    the settings would blame ``AI_SERVICE_SERVER__PORT``, which nobody set."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def _serve(args: argparse.Namespace) -> int:
    # SIGHUP's default action ends the process: until the app's handler (a reload) is set, and
    # after it is taken down, one is ignored (an edit of the config file is still picked up).
    # Set first, before any import that takes time (pydantic's, torch's)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # until uvicorn takes SIGTERM over (a drain), one ends start-up quietly with exit 0, as a drain
    # with nothing to drain would: its default action killed the process mid-import, exit -15.
    # SIGQUIT drains as SIGTERM does (``app.server``); its default action dumps core
    _on_stop_signals(_stop_early)
    logs = _Logs()
    try:
        return _serve_now(args, logs)
    except _StoppedEarly as stopped:
        _on_stop_signals(signal.SIG_IGN)  # a repeat while this is said would end it with a traceback
        _tell(logs, f"{stopped.name} before the server started: stopped", logging.WARNING)
        return 0
    except KeyboardInterrupt:  # Ctrl-C before uvicorn took it over (torch importing, say): no traceback
        _tell(logs, "interrupted before the server started", logging.WARNING)
        return EXIT_INTERRUPTED


def _tell(logs: _Logs, message: str, level: int = logging.ERROR) -> None:
    """``message`` on stderr, where the log goes: one JSON record (logger ``app.cli``) where the
    log is JSON, so that a collector reading the stream gets nothing else; else the plain line
    ``ai-backend: MESSAGE``. Where the settings were not read, ``_json_format_unread`` says which."""
    if logs.json_format is None:
        logs.json_format = _json_format_unread()
    if not logs.json_format:
        print(f"ai-backend: {message}", file=sys.stderr)
        return
    if not logs.ready:
        from app.telemetry.logging import configure_logging

        configure_logging("INFO", True)
        logs.ready = True
    log.log(level, "%s", message)


def _json_format_unread() -> bool:
    """``logging.json_format`` as the settings' sources (the environment, the config file) give
    it, for a message before the settings are read or where they were refused: only the logging
    group is read. Its default (JSON) where that group cannot be read either."""
    from pydantic import ValidationError
    from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

    from app.settings import Settings
    from app.settings.groups import LoggingSettings

    class LoggingOnly(BaseSettings):
        model_config = SettingsConfigDict(**{**Settings.model_config, "extra": "ignore"})  # Settings', all but extra

        logging: LoggingSettings = LoggingSettings()

        @classmethod
        def settings_customise_sources(  # type: ignore[override]  # pydantic-settings names each source
            cls, settings_cls: type[BaseSettings], **sources: PydanticBaseSettingsSource
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return Settings.settings_customise_sources(settings_cls, **sources)  # the same sources, in order

    try:
        return LoggingOnly().logging.json_format
    except (ValidationError, ValueError, OSError):  # the group refused, an unreadable file or variable
        return LoggingSettings().json_format


def _serve_now(args: argparse.Namespace, logs: _Logs) -> int:
    from app.settings import SettingsError, config_path, file_stamp, read_secrets, read_settings

    server_overrides: dict[str, object] = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    stamp = file_stamp(config_path())  # before the read: an edit from now on is a change to pick up
    try:
        settings = read_settings(server_overrides)
        logs.json_format = settings.logging.json_format
        read_secrets(settings)  # a token or key file that cannot be used: exit 2, before anything starts
    except SettingsError as exc:
        _tell(logs, str(exc))
        return EXIT_BAD_SETTINGS
    from app.telemetry.logging import configure_logging

    # set before torch is imported: what it warns of on import is a record of this log too
    configure_logging(settings.logging.level, settings.logging.json_format)
    logs.ready = True
    if (missing := _missing_device(settings.model.device)) is not None:  # imports torch: after the quick checks
        _tell(logs, missing)
        return EXIT_BAD_SETTINGS
    # imported only now: a bad setting is reported before torch takes seconds to import
    import uvicorn

    from app.api.edge import edge_protocol
    from app.environment import warn_unknown_variables
    from app.main import create_app
    from app.server import DrainingServer, shutdown_cuts_told

    logging.getLogger("uvicorn.error").addFilter(_reported_start_up_failure)
    logging.getLogger("uvicorn.error").addFilter(shutdown_cuts_told)
    warn_unknown_variables()
    _say_config_file(config_path(), stamp)

    failure: list[str] = []
    server: DrainingServer | None = None

    def on_fatal(message: str) -> None:
        log.critical("start-up failed: %s", message)
        failure.append(message)
        if server is not None:
            server.should_exit = True

    reread = functools.partial(read_settings, server_overrides)  # the command line's, over every reload
    app = create_app(settings, on_fatal=on_fatal, config_stamp=stamp, reread=reread)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_config=None,
        access_log=False,
        http=edge_protocol(app),  # overload refused by the protocol, before any ASGI work
        ws="none",  # no WebSocket endpoints: a handshake is served as the HTTP request it also is
        timeout_graceful_shutdown=int(settings.server.shutdown_grace_s) + 1,
    )

    async def drain() -> None:
        await app.state.service.drain(settings.server.shutdown_grace_s)

    def halt() -> None:
        service = getattr(app.state, "service", None)  # None before the lifespan made it
        if service is not None:
            service.halt()

    server = DrainingServer(config, drain, halt)
    code = _run(server, failure, f"{settings.server.host}:{settings.server.port}", logs)
    # stopped: what ``_serve`` set for start-up is back, and would take one more SIGTERM (an
    # orchestrator's repeat) for one before the start, "stopped", exit 0, skipping ``_exit_now``
    _on_stop_signals(signal.SIG_IGN)
    service = getattr(app.state, "service", None)  # None if the lifespan never ran
    if service is not None and service.unfinished:
        _exit_now(code, service.unfinished)
    return code


def _on_stop_signals(handler: Callable[[int, Any], object] | signal.Handlers) -> None:
    """``handler`` for the signals that stop the service (SIGTERM, SIGQUIT where there is one)."""
    for name in ("SIGTERM", "SIGQUIT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), handler)


def _say_config_file(path: Path, stamp: object) -> None:
    """Which config file the settings came from, absolute: the default is relative to the working
    directory, and started elsewhere the service ran on the built-in defaults without a word (its
    watcher polling a path that does not exist)."""
    if stamp is None:
        log.warning("no config file at %s: the built-in defaults and the environment apply", path.resolve())
    else:
        log.info("settings read from the config file %s and the environment", path.resolve())


def _missing_device(setting: str) -> str | None:
    """Why ``model.device`` names a device this machine does not have (``cuda`` without CUDA);
    None if it does. Checked as the secrets are, before the server starts: from the app's
    start-up the one line came with uvicorn's traceback, and exit 1 as for a start that failed.
    ``auto`` is left to the start-up, which tries the GPU out off the event loop."""
    if setting == "auto":
        return None
    from app.inference.device import DeviceMissing, resolve_device

    try:
        resolve_device(setting)
    except DeviceMissing as exc:
        return str(exc)
    return None


def _reported_start_up_failure(record: logging.LogRecord) -> bool:
    """A filter for uvicorn's log: drops its traceback of a ``StartupFailed`` (the app's start-up
    failure it has named already, through ``on_fatal``, in one line, which the text log says again at exit)."""
    text = record.msg
    if record.levelno < logging.ERROR or not isinstance(text, str) or not text.startswith("Traceback"):
        return True
    from app.main import StartupFailed  # imported by then: the app's

    named = f"{StartupFailed.__module__}.{StartupFailed.__qualname__}:"
    return not text.rstrip().rpartition("\n")[2].startswith(named)


def _run(server: DrainingServer, failure: list[str], address: str, logs: _Logs) -> int:
    """Serve until the server stops; the exit code. A start-up failure is said last: in text,
    the line ``ai-backend: start-up failed: ...`` (the app's own failure was logged already, and
    is said again as the last line a person reads); in JSON, one record, unless the app's own
    failure was logged as one already."""
    logged = True
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it caught once it has shut down (when
        return EXIT_INTERRUPTED  # asyncio's runner turns it into one: not if serving ended first)
    except SystemExit:  # uvicorn's own start-up failure (the port in use, say): logged by it
        if not failure:  # the app's own failure was named already
            failure.append(f"the server could not start on {address}")
            logged = False
    if failure:
        if not logs.json_format or not logged:
            _tell(logs, f"start-up failed: {failure[0]}", logging.CRITICAL)
        return EXIT_START_FAILED
    if not server.started:
        return EXIT_START_FAILED
    return EXIT_INTERRUPTED if server.interrupted else 0


def _exit_now(code: int, threads: list[str]) -> NoReturn:
    """End the process with ``code`` without finalizing the interpreter: ``threads`` are still
    inside a call that outlasted the shutdown's bounded joins (a large model's warm-up that a
    SIGTERM cut short, say). Torch, torn down at interpreter exit under such a thread, aborts
    the process ("terminate called without an active exception", exit -6). Everything with a
    stop has stopped by now; the logs are flushed first."""
    log.warning("exiting with %s still inside a call that outlasted the shutdown", ", ".join(threads))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# subcommands that parse their own arguments: name -> (module, help)
_DELEGATED = {
    "export": ("app.inference.export", "export a torchvision model into the model repository"),
    "train-digits": ("app.training.digits", "train the bundled digits model"),
    "bench": ("app.bench.loadgen.cli", "send bounded load to a running service on loopback"),
    "sweep": ("app.bench.sweep.cli", "time a model in process at batch sizes 1..N and find the knee"),
    "limit": ("app.bench.limit.cli", "measure the in-process images/s limit of a model on this machine"),
    "core": ("app.bench.core", "measure the service's throughput in process, with no HTTP in front of it"),
    "floor": ("app.bench.floor", "serve predictions behind the least HTTP possible (a benchmark reference)"),
    "eval": ("app.lifecycle.evaluate", "evaluate a model version on a held-out set and record it in its manifest"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ai-backend`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ai-backend", description="An inference service for PyTorch models.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the model repository over HTTP")
    serve.add_argument("--host", help="bind address (default: server.host, 127.0.0.1)")
    serve.add_argument("--port", type=_port, help="port, 0-65535 (default: server.port, 8000)")
    for name, (_, help_text) in _DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    if argv and argv[0] in _DELEGATED:
        module = importlib.import_module(_DELEGATED[argv[0]][0])
        code: int = module.main(argv[1:])
        return code
    args = parser.parse_args(argv)
    return _serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
