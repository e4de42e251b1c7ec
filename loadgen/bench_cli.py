"""``kvkeeper bench run|report|ceiling``: drive a workload, render reports, compute ceilings.

More ``bench`` subcommands plug in like the top-level ones: a module named in
``_EXTRA_MODULES`` exposing ``register(bench_subparsers)`` (e.g. the lead's ``compare``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadgen.extras import needs_bench
from loadgen.workloads import WORKLOADS, build_workload, load_spec, parse_overrides
from loadgen.workloads.base import Workload
from loadgen.workloads.hints import HINT_MODES, HintPolicy
from loadgen.workloads.trace import TRACE_DIR_ENV

_EXTRA_MODULES = ("loadgen.compare_cli",)
_WITHOUT_EXTRA = frozenset({"ceiling"})  # pure computation: no plots, no progress bar
if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(subparsers: Subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: run workloads, reports, ceilings")
    bench.set_defaults(func=lambda _args: _usage(bench))
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    _register_run(sub)
    _register_report(sub)
    _register_ceiling(sub)
    for name in _EXTRA_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    for name, parser in sub.choices.items():
        prog, func = f"kvkeeper bench {name}", parser.get_default("func")
        if name not in _WITHOUT_EXTRA:
            func = needs_bench(prog, func)
        parser.set_defaults(func=_one_line_errors(prog, func))


def _one_line_errors(
    prog: str, func: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """A bad workload, trace set or target is one line on stderr and exit 2, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ValueError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2

    return run


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _add_workload_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=default,
        help="workload name (or give --spec)",
    )
    p.add_argument("--spec", help="YAML spec: {workload: NAME, params: {...}}")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload parameter (repeatable), e.g. --set users=8",
    )
    p.add_argument("--seed", type=int, help="shortcut for --set seed=N")
    p.add_argument("--token-scale", type=float, help="shortcut for --set token_scale=X")
    p.add_argument(
        "--trace-dir",
        metavar="DIR",
        help="trace workload: a directory of trace files, or one file (shortcut for --set "
        f"path=DIR; default: ${TRACE_DIR_ENV}, else the Claude Code traces shipped with kvkeeper)",
    )


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload named by ``--spec``/``--workload`` with ``--set`` overrides applied."""
    name, params = load_spec(args.spec) if args.spec else (args.workload, {})
    if args.workload and args.spec:
        name = args.workload
    if not name:
        raise ValueError("give --workload or --spec")
    params.update(parse_overrides(args.overrides))
    if args.seed is not None:
        params["seed"] = args.seed
    if args.token_scale is not None:
        params["token_scale"] = args.token_scale
    if args.trace_dir is not None:
        if name != "trace":
            raise ValueError("--trace-dir is for --workload trace")
        params["path"] = args.trace_dir
    return build_workload(name, params)


# --- run -----------------------------------------------------------------------------------------
def _register_run(sub: Subparsers) -> None:
    p = sub.add_parser("run", help="play a workload against an OpenAI-compatible URL")
    _add_workload_args(p, None)
    p.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--hints", choices=HINT_MODES, default="none")
    p.add_argument(
        "--api",
        choices=("chat", "completions", "completions-ids"),
        help="request form (default: the workload's; trace uses token ids)",
    )
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=int, default=32, help="model requests in flight")
    p.add_argument("--max-sessions", type=int, default=0, help="open root sessions (0: all)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies all pauses")
    p.add_argument("--ttl-factor", type=float, default=2.0)
    p.add_argument("--ttl-cap", type=float, default=600.0)
    p.add_argument("--prefetch-lead", type=float, default=1.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from loadgen.metrics import summarize
    from loadgen.runner import RunOptions, Target, run_workload

    workload = workload_from_args(args)
    hints = HintPolicy(
        args.hints,
        ttl_factor=args.ttl_factor,
        ttl_cap=args.ttl_cap,
        prefetch_lead=args.prefetch_lead,
    )
    target = Target(args.target, args.model, hints, api=args.api, api_key=args.api_key)
    options = RunOptions(
        concurrency=args.concurrency,
        max_sessions=args.max_sessions,
        time_scale=args.time_scale,
        progress=not args.no_progress,
        request_timeout=args.request_timeout,
    )
    result = asyncio.run(run_workload(workload, target, options, label=args.label))
    result.save(args.out)
    summary = summarize(result)
    print(json.dumps({k: v for k, v in summary.items() if k != "by_agent"}, indent=1))
    return 0 if summary["errors"] == 0 else 1


# --- report --------------------------------------------------------------------------------------
def _register_report(sub: Subparsers) -> None:
    p = sub.add_parser("report", help="Markdown table + PNG plots of several run results")
    p.add_argument("results", nargs="+", help="result JSON files written by 'bench run'")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from loadgen.records import RunResult
    from loadgen.report import render_report

    results = [RunResult.load(path) for path in args.results]
    path = render_report(results, args.out)
    print(path.read_text().split("\n\n")[1])
    print(f"report: {path}")
    return 0


# --- ceiling -------------------------------------------------------------------------------------
def _register_ceiling(sub: Subparsers) -> None:
    p = sub.add_parser("ceiling", help="cache-hit ceilings: infinite, Belady and LRU")
    _add_workload_args(p, "trace")
    p.add_argument(
        "--arrival",
        choices=("lanes", "slots", "open"),
        help="arrival model (default: lanes for trace, open otherwise)",
    )
    p.add_argument("--concurrency", default="8,16", help="open sessions N (list)")
    p.add_argument("--capacity", default="0.25,0.5", help="cache sizes as shares of peak W")
    p.add_argument("--policies", default="lru,belady")
    p.add_argument("--lane-seed", type=int, default=0, help="seed of the lanes' tape order")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--emit-blocks", help="write the laid-out block sequence here (JSONL)")
    p.set_defaults(func=_cmd_ceiling)


def _cmd_ceiling(args: argparse.Namespace) -> int:
    from loadgen import ceiling

    workload = workload_from_args(args)
    arrival: ceiling.Arrival = args.arrival or ("lanes" if workload.name == "trace" else "open")
    levels = [int(x) for x in args.concurrency.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    for policy in policies:
        if policy not in ceiling.POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {ceiling.POLICIES}")
    if args.emit_blocks:
        _emit_blocks(
            ceiling.layout(workload, arrival, levels[0], seed=args.lane_seed),
            Path(args.emit_blocks),
        )
    results = ceiling.ceilings(
        workload,
        arrival=arrival,
        concurrency=levels,
        policies=policies,
        seed=args.lane_seed,
        capacities=[float(x) for x in args.capacity.split(",") if x],
    )
    title = f"{workload.name} ceilings ({arrival})"
    print(ceiling.render_markdown(results, title))
    if args.json:
        doc: dict[str, Any] = {
            "workload": workload.name,
            "params": dict(workload.params),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def _emit_blocks(replay: Any, path: Path) -> None:
    with path.open("w") as f:
        for r in replay.reqs:
            f.write(
                json.dumps(
                    {"arrival": r.arrival, "finish": r.finish, "tokens": r.tokens, "blocks": r.keys}
                )
                + "\n"
            )


def main(argv: list[str] | None = None) -> int:
    """``python -m loadgen.bench_cli`` without the top-level tree."""
    parser = argparse.ArgumentParser(prog="bench")
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
