"""``kvkeeper serve``: run the proxy. Flags > environment (KVKEEPER_*) > YAML config > defaults."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from proxy.logs import configure_logging
from proxy.serving import listening_line, reason, serve, worker_main
from proxy.settings import ConfigError, Settings, load_settings
from proxy.workers import Supervisor, probe_port, worker_count


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
        help="processes sharing the port (default: the usable cores or the container's CPU limit, at most 4)",
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
        print(f"kvkeeper serve: error: cannot listen on {where}: {reason(exc)}", file=sys.stderr)
        return 1
    return Supervisor(
        settings,
        count,
        lambda: print(f"{listening_line(settings)} ({count} workers)", flush=True),
        worker_main,
    ).run()
