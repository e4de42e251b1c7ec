"""The ``kvkeeper`` command: one argparse tree, each subcommand defined in its own module.

A subcommand module exposes ``register(subparsers)``; the parser it adds sets ``func`` to a
callable taking the parsed namespace and returning the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# Modules that add subcommands, in the order ``--help`` lists them.
_SUBCOMMAND_MODULES = (
    "proxy.serve_cli",  # serve
    "proxy.sessions_cli",  # sessions list|show|free
    "proxy.engine_cli",  # engine up|down|status (local vLLM on CPU)
    "loadgen.sim_cli",  # sim
    "loadgen.bench_cli",  # bench ...
    "loadgen.demo_cli",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvkeeper",
        description="KV-cache control proxy for agent swarms in front of unmodified engines.",
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
