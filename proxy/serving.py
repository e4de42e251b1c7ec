"""Serve the proxy in this process: the one-process ``kvkeeper serve`` and each worker of
``serve --workers N``."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import multiprocessing
import sys
from collections.abc import Callable
from multiprocessing.synchronize import Event as MPEvent
from typing import Any

from aiohttp import web

from proxy.children import exit_with_parent
from proxy.logs import configure_logging
from proxy.settings import ConfigError, Settings

log = logging.getLogger("kvkeeper.serve")


async def _freeze_startup_objects(app: web.Application) -> None:
    """Move everything built at start-up out of the collector's reach: full collections then
    only walk what requests allocate, which shortens the pauses they add to the data plane."""
    gc.collect()
    gc.freeze()


def listening_line(settings: Settings) -> str:
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
            print(listening_line(settings), flush=True)

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
        print(f"kvkeeper serve: error: cannot listen on {where}: {reason(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # Redis, an engine spec ...: one line, the traceback at DEBUG
        log.debug("start-up failed", exc_info=True)
        print(f"kvkeeper serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def worker_main(dump: dict[str, Any], ready: MPEvent) -> None:
    """One worker process: the settings the parent resolved, served on the shared port."""
    settings = Settings(**dump)
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        exit_with_parent(parent.pid)  # a killed supervisor's workers drain and exit (SIGTERM)
    raise SystemExit(serve(settings, reuse_port=True, on_ready=ready.set))


def reason(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "address already in use (another process listens on that port)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "address not available on this machine"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return exc.strerror or str(exc)
