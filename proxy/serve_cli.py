"""``kvkeeper serve``: run the proxy. Flags > environment (KVKEEPER_*) > YAML config > defaults."""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.logs import configure_logging
from proxy.settings import ConfigError, Settings, load_settings
from proxy.workers import Supervisor, probe_port, worker_count

log = logging.getLogger("kvkeeper.serve")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the kvkeeper proxy",
        description="Run the kvkeeper proxy in front of one or more OpenAI-compatible engines. "
        "Settings come from flags, then KVKEEPER_* environment variables, then --config YAML.",
    )
    p.add_argument("--config", type=Path, help="YAML settings file")
    p.add_argument("--host", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument(
        "--engine",
        action="append",
        metavar="URL",
        help="engine base URL, repeatable (http://host:port)",
    )
    p.add_argument(
        "--engine-events",
        action="append",
        metavar="ENDPOINT",
        help="KV-event endpoint (tcp://host:port) of the i-th --engine, repeatable",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        help="redis://host:port/db, or redis+sentinel://host:port[,host:port]/service "
        "or redis-cluster://host:port[,host:port] (default: embedded private Redis)",
    )
    p.add_argument("--tenants-file", type=Path, help="YAML file mapping API keys to tenants")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING ... (default INFO)")
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_const",
        const=False,
        help="no line per request (default: one line per request at INFO)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="log lines as text or one JSON object each (default text)",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="processes sharing the port (default: the usable cores, at most 4)",
    )
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "redis_url": args.redis,
        "tenants_file": args.tenants_file,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "access_log": args.access_log,
        "workers": args.workers,
    }
    if args.engine:
        events = args.engine_events or []
        if len(events) > len(args.engine):
            raise ConfigError("more --engine-events than --engine flags")
        overrides["engines"] = [
            {"url": url, "events": events[i] if i < len(events) else None}
            for i, url in enumerate(args.engine)
        ]
    elif args.engine_events:
        raise ConfigError("--engine-events needs a matching --engine")
    return load_settings(args.config, **overrides)


async def _freeze_startup_objects(app: web.Application) -> None:
    """Move everything built at start-up out of the collector's reach: full collections then
    only walk what requests allocate, which shortens the pauses they add to the data plane."""
    gc.collect()
    gc.freeze()


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"kvkeeper serve: error: {exc}", file=sys.stderr)
        return 2
    # an ephemeral port (0) cannot be shared: one process
    count = worker_count(settings.workers) if settings.port else 1
    if count == 1:
        return serve(settings)
    configure_logging(settings.log_level, settings.log_format, access_log=settings.access_log)
    try:  # the port, checked once here: a busy one is one error line, not one per worker
        probe_port(settings.host, settings.port)
    except OSError as exc:
        where = f"http://{settings.host}:{settings.port}"
        print(f"kvkeeper serve: error: cannot listen on {where}: {_reason(exc)}", file=sys.stderr)
        return 1
    return Supervisor(
        settings, count, lambda: print(f"{_listening(settings)} ({count} workers)", flush=True)
    ).run()


def _listening(settings: Settings) -> str:
    engines = ", ".join(e.url for e in settings.engines)
    return f"kvkeeper listening on http://{settings.host}:{settings.port} -> {engines}"


def serve(
    settings: Settings, *, reuse_port: bool = False, on_ready: Callable[[], None] | None = None
) -> int:
    """Serve until a signal; one process. ``reuse_port`` for a worker sharing the port (which
    then calls ``on_ready`` once it listens instead of printing the address)."""
    try:
        from proxy.app import create_app, server_options

        app = create_app(settings)
    except ConfigError as exc:
        print(f"kvkeeper serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, access_log=settings.access_log)
    app.on_startup.append(_freeze_startup_objects)
    where = f"http://{settings.host}:{settings.port}"

    def listening(_: object) -> None:  # called once the socket is bound (after start-up)
        if on_ready is not None:
            on_ready()
        else:
            print(_listening(settings), flush=True)

    try:  # uvloop: a faster event loop where available (Linux, macOS)
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    try:
        web.run_app(
            app,
            host=settings.host,
            port=settings.port,
            reuse_port=reuse_port or None,
            handler_cancellation=True,  # a client that goes away cancels its upstream request
            **server_options(settings),
            access_log=None,  # proxy/access.py logs every request instead
            print=listening,
        )
    except OSError as exc:  # the port is taken, the address is not ours ...
        log.debug("start-up failed", exc_info=True)
        print(f"kvkeeper serve: error: cannot listen on {where}: {_reason(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # Redis, an engine spec ...: one line, the traceback at DEBUG
        log.debug("start-up failed", exc_info=True)
        print(f"kvkeeper serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _reason(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "address already in use (another process listens on that port)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "address not available on this machine"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return exc.strerror or str(exc)
