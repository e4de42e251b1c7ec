"""The ``kvkeeper`` command: one argparse tree, each subcommand defined in its own module.

A subcommand module exposes ``register(subparsers)``; the parser it adds sets ``func`` to a
callable taking the parsed namespace and returning the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

# Modules that add subcommands, in the order ``--help`` lists them.
_SUBCOMMAND_MODULES = (
    "proxy.serve_cli",  # serve
    "proxy.sessions_cli",  # sessions list|show|free|offload|prefetch|evict|pin, engines
    "proxy.engine_cli",  # engine up|down|status (local vLLM on CPU)
    "loadgen.sim_cli",  # sim
    "loadgen.bench_cli",  # bench ...
    "loadgen.demo_cli",  # demo
)


def version() -> str:
    """The installed package's version; ``0+unknown`` from a bare source tree."""
    try:
        return metadata.version("kvkeeper")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvkeeper",
        description="KV-cache control proxy for agent swarms in front of unmodified engines.",
        epilog="`kvkeeper COMMAND --help` shows a command's options and their defaults.",
    )
    parser.add_argument("--version", action="version", version=f"kvkeeper {version()}")
    # admin commands (sessions, engines) also take --json after the command or its action
    parser.add_argument(
        "--json",
        dest="json_output",
        action="store_true",
        help="admin commands print the API's JSON instead of tables",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # subcommand not built yet; anything else is a real error
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
