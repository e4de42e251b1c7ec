"""The ``bench`` extra: what the load generator, its reports and the demo need beyond the
service (``kvkeeper serve`` runs without it)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

BENCH_MODULES = ("matplotlib", "tqdm")  # imported lazily, only by the commands that use them
INSTALL_HINT = 'pip install -e ".[bench]" in a checkout, or pip install "kvkeeper[bench]"'

Command = Callable[[argparse.Namespace], int]


def missing_bench_modules() -> list[str]:
    return [name for name in BENCH_MODULES if importlib.util.find_spec(name) is None]


def needs_bench(prog: str, func: Command) -> Command:
    """``func``, answering a one-line hint (exit 2) instead of a traceback without the extra."""

    def run(args: argparse.Namespace) -> int:
        if lacking := missing_bench_modules():
            print(
                f"{prog}: needs the bench extra ({', '.join(lacking)} not installed): "
                + INSTALL_HINT,
                file=sys.stderr,
            )
            return 2
        return func(args)

    return run
