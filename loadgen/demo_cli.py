"""``kvkeeper demo``: the main job on embedded defaults, in under two minutes.

It starts the engine simulator (a vLLM-exact block pool under cache pressure) twice, once per
target, and plays the same agent swarm against each: a supervisor and specialised workers whose
long system prompts (anchors) are shared by every user session, with tool pauses between turns.

* ``direct``: straight to the engine, as an agent framework would without kvkeeper;
* ``kvkeeper``: through ``kvkeeper serve`` (embedded Redis) with the hints a well-integrated
  framework sends (session and parent ids, a TTL across each tool pause, evict when done,
  prefetch before a resume).

It prints a side-by-side table and writes ``results/demo/`` (report.md, summary.json, PNGs).
Nothing is faked: both columns are measured in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

from loadgen.extras import needs_bench
from loadgen.metrics import summarize
from loadgen.records import RunResult
from loadgen.report import render_report
from loadgen.runner import RunOptions, Target, run_workload
from loadgen.sim import SimConfig, run_simulator_process
from loadgen.stack import start_kvkeeper
from loadgen.workloads import build_workload
from loadgen.workloads.hints import HintPolicy

# A swarm small enough for two minutes, big enough that its anchors and histories overflow the
# pool: 8 users, 6 agents with 1-4K-token anchors, 400 blocks of 32 tokens (12.8K tokens) of KV,
# about 70% of the swarm's peak working set.
SWARM = {
    "users": 8,
    "agents": 6,
    "arrival_rate": 1.0,
    "anchor_min": 1000,
    "anchor_max": 4000,
    "task_tokens": 200,
    "tool_result_tokens": 150,
    "output_tokens": 32,
    "min_dispatches": 3,
    "max_dispatches": 6,
    "pause_min": 1.0,
    "pause_cap": 30.0,
}
POOL_BLOCKS = 400


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run an agent swarm on the simulator, straight and through kvkeeper, side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, default=Path("results/demo"), help="where to write the report"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--users", type=int, default=SWARM["users"])
    p.add_argument(
        "--num-blocks",
        type=int,
        default=POOL_BLOCKS,
        help="simulated KV pool (blocks of 32 tokens)",
    )
    p.add_argument("--time-scale", type=float, default=0.4, help="multiplies tool pauses")
    p.add_argument(
        "--speed", type=float, default=6.0, help="simulator speed-up over the cpu-smollm2 profile"
    )
    p.set_defaults(func=needs_bench("kvkeeper demo", run))


async def _one(args: argparse.Namespace, label: str, hints: str) -> RunResult:
    workload = build_workload("swarm", {**SWARM, "users": args.users, "seed": args.seed})
    sim_cfg = SimConfig(
        num_blocks=args.num_blocks, profile="cpu-smollm2", speed=args.speed, reply_tokens=32
    )
    options = RunOptions(concurrency=16, time_scale=args.time_scale, run_tag=label)
    async with run_simulator_process(sim_cfg) as sim:
        if label == "direct":
            target = Target(sim.url, "sim", hints=HintPolicy(mode="none"))
            return await run_workload(workload, target, options, label=label)
        # kvkeeper with its embedded Redis (no URL), as `kvkeeper serve` runs by default
        retention = {"tick_s": 0.1}
        logs = args.out / "logs"
        token = os.environ.setdefault("KVKEEPER_ADMIN_TOKEN", secrets.token_urlsafe(12))
        async with start_kvkeeper([sim], None, logs, retention=retention, offload=False) as url:
            print(f"console (live while this run lasts): {url}/ui/#token={token}", flush=True)
            target = Target(url, "sim", hints=HintPolicy(mode=hints))  # type: ignore[arg-type]
            return await run_workload(workload, target, options, label=label)


def _row(name: str, s: dict[str, Any]) -> str:
    ttft = s["ttft"]
    over = s.get("retention_recomputed_tokens")
    return (
        f"| {name} | {s['requests']} | {s['hit_rate'] * 100:.1f}% | {ttft['mean'] * 1e3:.0f} ms | "
        f"{ttft['p90'] * 1e3:.0f} ms | {s['recomputed_prompt_tokens']:,} | "
        f"{'-' if over is None else f'{over:,.0f}'} |"
    )


def table(results: list[RunResult]) -> str:
    lines = [
        "| target | requests | prefix-cache hit rate | mean TTFT | p90 TTFT | recomputed prompt tokens | retention tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    summaries = [summarize(r) for r in results]
    lines += [_row(r.label, s) for r, s in zip(results, summaries, strict=True)]
    if len(summaries) == 2 and summaries[0]["ttft"]["mean"]:
        a, b = summaries
        lines.append(
            f"\nkvkeeper vs direct: hit rate {(b['hit_rate'] - a['hit_rate']) * 100:+.1f} pp, "
            f"mean TTFT {b['ttft']['mean'] / a['ttft']['mean']:.2f}x, "
            f"p90 TTFT {b['ttft']['p90'] / a['ttft']['p90']:.2f}x, "
            f"recomputed tokens {b['recomputed_prompt_tokens'] / max(1, a['recomputed_prompt_tokens']):.2f}x"
        )
    return "\n".join(lines)


async def demo(args: argparse.Namespace) -> int:
    print(
        f"kvkeeper demo: agent swarm ({args.users} users, 6 agents with shared anchors, tool pauses) "
        f"on a simulated engine with {args.num_blocks} KV blocks; run 1/2 straight to the engine",
        flush=True,
    )
    direct = await _one(args, "direct", "none")
    print("run 2/2 through kvkeeper (embedded Redis) with full hints", flush=True)
    kept = await _one(args, "kvkeeper", "full")
    report = render_report([direct, kept], args.out)
    print()
    print(table([direct, kept]))
    print(f"\nreport: {report}  plots: {args.out / 'ttft_cdf.png'}, {args.out / 'hit_rate.png'}")
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(demo(args))
