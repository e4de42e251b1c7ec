"""``kvkeeper bench compare``'s command line: the options, the spec they build, the exit code.

The comparison itself is :func:`loadgen.bench_compare.run_compare`; its targets are the
registry in :mod:`loadgen.bench_targets`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loadgen.bench_cli import _add_workload_args, workload_from_args
from loadgen.bench_compare import CompareSpec, run_compare
from loadgen.bench_targets import TARGETS
from loadgen.compare_render import render_aggregate, render_markdown
from loadgen.runner import RunOptions
from loadgen.sim.engine import SCHEDULING_POLICIES
from loadgen.sim.profiles import PROFILES
from loadgen.sim.server import SimConfig
from loadgen.stack import find_router
from loadgen.workloads import parse_overrides
from loadgen.workloads.hints import HintPolicy
from proxy.children import interrupt_on_sigterm

if TYPE_CHECKING:
    from loadgen.bench_cli import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "compare", help="one workload against engine / kvkeeper hint modes / routers"
    )
    _add_workload_args(p, None)
    p.add_argument(
        "--targets",
        default="",
        help=(
            "comma list (default: the default ones that apply); a kvkeeper target takes "
            "retention settings after '@', e.g. full+pins@tier_pin_share=0.8. Targets: "
            + "; ".join(f"{n}: {t.help}" for n, t in TARGETS.items())
        ),
    )
    p.add_argument("--replicas", type=int, default=1, help="engine replicas (simulator)")
    p.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="real engine instead of the simulator (repeatable)",
    )
    p.add_argument(
        "--engine-events",
        action="append",
        default=[],
        help="KV-event endpoint of the i-th --engine-url",
    )
    p.add_argument("--capacity-blocks", type=int, help="ceiling capacity for --engine-url")
    p.add_argument(
        "--profile", default="h100-llama8b", choices=sorted(PROFILES), help="simulator timing"
    )
    p.add_argument("--speed", type=float, default=1.0, help="simulator time speed-up")
    p.add_argument("--sim-max-lag", type=float, default=SimConfig().max_lag_s, metavar="SECONDS",
                   help="how far the simulators' step loops may run behind their modelled "
                        "clocks and catch up (`kvkeeper sim --max-lag-s`)")  # fmt: skip
    p.add_argument(
        "--num-blocks", type=int, default=2048, help="simulator pool (without --pool-frac)"
    )
    p.add_argument("--pool-frac", type=float, help="pool as a share of the peak working set")
    p.add_argument("--cpu-blocks", type=int, default=0, help="simulator CPU tier (0: none)")
    p.add_argument(
        "--cpu-l2-blocks",
        type=int,
        default=0,
        help="the simulator CPU tier's L2, LMCache MP-shaped: L1 LRU, pins protect L2 (0: none)",
    )
    p.add_argument("--no-offload", action="store_true", help="do not give kvkeeper the CPU tier")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="the simulators' waiting-queue order (every target's engine)",
    )
    p.add_argument("--max-model-len", type=int, default=262_144)
    p.add_argument("--model", default="sim")
    p.add_argument(
        "--api",
        default="completions-ids",
        choices=("chat", "completions", "completions-ids", "workload"),
    )
    p.add_argument("--concurrency", type=int, default=64, help="model requests in flight")
    p.add_argument("--max-sessions", type=int, default=0, help="open root sessions (0: all)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies all pauses")
    p.add_argument("--ttl-factor", type=float, default=2.0)
    p.add_argument("--ttl-cap", type=float, default=600.0)
    p.add_argument("--prefetch-lead", type=float, default=1.0)
    p.add_argument(
        "--end-turn-ttl",
        type=float,
        default=0.0,
        help="full hints: TTL asked on calls that end a turn (0: none; an experiment)",
    )
    p.add_argument(
        "--end-turn-from",
        type=int,
        default=0,
        help="--end-turn-ttl from this step of a session on (0: every call)",
    )
    p.add_argument(
        "--no-end-evict",
        action="store_true",
        help="full hints: no evict when a session finishes (the client cannot know it is over)",
    )
    p.add_argument(
        "--retention",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="kvkeeper retention setting (repeatable)",
    )
    p.add_argument(
        "--router", help="vllm-router executable (default: $KVKEEPER_VLLM_ROUTER, else on PATH)"
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="play the comparison this many times and report mean and range (default 1)",
    )
    p.add_argument(
        "--base",
        metavar="TARGET",
        help="the reference of `vs base` and gap closed, one of the targets "
        "(default: engine, else round-robin, else none; with --cpu-blocks, engine-notier "
        "measures against vanilla vLLM without the tier)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_compare)


def spec_from_args(args: argparse.Namespace) -> CompareSpec:
    sim = SimConfig(
        model=args.model,
        profile=args.profile,
        speed=args.speed,
        max_lag_s=args.sim_max_lag,
        num_blocks=args.num_blocks,
        cpu_blocks=args.cpu_blocks,
        cpu_l2_blocks=args.cpu_l2_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
    )
    return CompareSpec(
        out=Path(args.out),
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        replicas=args.replicas if not args.engine_url else len(args.engine_url),
        sim=sim,
        pool_frac=args.pool_frac,
        engine_urls=tuple(args.engine_url),
        engine_events=tuple(args.engine_events),
        capacity_blocks=args.capacity_blocks,
        options=RunOptions(
            concurrency=args.concurrency,
            max_sessions=args.max_sessions,
            time_scale=args.time_scale,
            progress=not args.no_progress,
        ),
        hints=HintPolicy(
            ttl_factor=args.ttl_factor,
            ttl_cap=args.ttl_cap,
            prefetch_lead=args.prefetch_lead,
            end_turn_ttl=args.end_turn_ttl,
            end_turn_from=args.end_turn_from,
            end_evict=not args.no_end_evict,
        ),
        api=None if args.api == "workload" else args.api,
        retention=parse_overrides(args.retention),
        offload=not args.no_offload,
        router=find_router(args.router),
        model=args.model,
        repeats=max(1, args.repeats),
        base=args.base,
    )


def _cmd_compare(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    spec = spec_from_args(args)
    interrupt_on_sigterm()  # a SIGTERM stops the stacks started, as Ctrl-C does
    try:
        doc = asyncio.run(run_compare(workload, spec))
    except ValueError as e:  # a bad target list or --base: refused before anything ran
        print(f"kvkeeper bench compare: error: {e}", file=sys.stderr)
        return 2
    if spec.repeats > 1:
        print(render_aggregate(doc))
        errors = sum(t.get("errors", {}).get("max", 0) for t in doc["targets"].values())
    else:
        print(render_markdown(doc))
        errors = sum(t.get("errors", 0) for t in doc["targets"].values())
    print(f"results: {spec.out}")
    return 0 if errors == 0 else 1
