"""``kvkeeper demo``: vanilla vLLM, vLLM + plain LMCache, and vLLM + LMCache + kvkeeper, side by side.

It plays one agent swarm (a supervisor and specialised workers whose long system prompts and
tool definitions every user session shares, with tool pauses between turns) against three stacks on
the engine simulator (a vLLM-exact block pool under cache pressure, Llama-3.1-8B on one H100
timing), each on fresh processes. The pool holds half the swarm's peak working set.

* ``vLLM``: straight to the engine, no offload tier (an agent framework without kvkeeper);
* ``vLLM + LMCache``: the same engine with an LMCache-shaped CPU tier as large as the pool
  (written through, LRU), still straight to it;
* ``vLLM + LMCache + kvkeeper``: the same engine and tier behind ``kvkeeper serve`` on its
  default settings (embedded Redis), the client sending the hints a well-integrated framework
  sends (session and parent ids, a TTL across each tool pause, evict when done, prefetch before
  a resume). kvkeeper finds the tier and the engine's scheduling policy by itself.

Every engine runs ``--scheduling-policy priority``; requests that carry no priority are served
first come, first served, so the two baselines see plain vLLM. Three rounds each play the three
stacks once, in a rotated order, so a change in the machine's load falls on every stack in every
position: hit rate and tokens pool the rounds, TTFT is the median of the rounds. It prints the
three side by side with what kvkeeper did, and writes ``results/demo/`` (report.md,
summary.json, PNGs; each round's runs in ``round<k>/``). Nothing is faked: every column is
measured in this run. ``--real`` runs the same three on the real CPU vLLM + LMCache MP stack
(:mod:`loadgen.demo_real`; ``bash deploy/local/engine-setup.sh`` and
``bash deploy/local/lmcache-install.sh`` first).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.compare_ceilings import planned_ceilings
from loadgen.demo_report import POOL_SHARE, TARGETS, did_from, finish, order, progress
from loadgen.extras import needs_bench
from loadgen.records import RunResult
from loadgen.runner import RunOptions, Target, run_workload
from loadgen.sim import SimConfig, run_simulator_process
from loadgen.stack import start_kvkeeper
from loadgen.workloads import build_workload
from loadgen.workloads.base import Workload
from loadgen.workloads.hints import HintPolicy
from proxy.children import interrupt_on_sigterm

# The swarm benchmark's setting (BENCHMARKS.md section 1) scaled to 8 users per round:
# 6 agents with 2-8K-token shared system prompts; pauses x0.25 on a simulator 4x faster keep the
# timeline's shape in the engine's modelled time. The pool is half the round's peak working set
# (blocks of 32), the tier as large.
SWARM: dict[str, Any] = {"users": 8}
ROUNDS = 3


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="vanilla vLLM, vLLM + LMCache and vLLM + LMCache + kvkeeper on one swarm, side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="the real CPU vLLM + LMCache MP stack instead of the simulator (needs "
        "deploy/local/engine-setup.sh and deploy/local/lmcache-install.sh)",
    )
    p.add_argument("--out", type=Path, default=None, help="report folder (results/demo[-real])")
    p.add_argument("--seed", type=int, default=None, help="the swarm's seed (every round)")
    p.add_argument("--users", type=int, default=None, help="user sessions per round")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds; each plays the three stacks once, in a rotated order (sim 3, --real 1)",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool in blocks of 32 (half the round's peak working set; --real: at least 129)",
    )
    p.add_argument(
        "--tier-blocks", type=int, default=None, help="the simulator's CPU tier (the pool's size)"
    )
    p.add_argument(
        "--time-scale", type=float, default=None, help="multiplies tool pauses (sim 0.25, --real 1)"
    )
    p.add_argument(
        "--speed", type=float, default=4.0, help="simulator speed-up over the h100-llama8b profile"
    )
    p.add_argument(
        "--l1-gb", default=None, help="--real: LMCache L1 size in GB (default: the KV pool's size)"
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="--real: start the engines with vLLM's --enforce-eager (no torch.compile: a quicker "
        "start, slower decoding; for tests, not for the figures)",
    )
    p.set_defaults(func=needs_bench("kvkeeper demo", run))


async def _kvkeeper_did(url: str, keep: Path) -> dict[str, float]:
    """What kvkeeper did over its run; the whole exposition is kept in ``keep``."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(url + "/metrics") as resp,
        ):
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    await asyncio.to_thread(keep.write_text, text)
    return did_from(text)


def pool_blocks(workload: Workload, time_scale: float) -> int:
    """Half the workload's peak working set (blocks), on the ceiling tool's timeline."""
    options = RunOptions(time_scale=time_scale)
    return int(planned_ceilings(workload, options, POOL_SHARE, None)["C"])


async def _one(
    args: argparse.Namespace, workload: Workload, label: str, tag: str
) -> tuple[RunResult, dict[str, float]]:
    sim_cfg = SimConfig(
        num_blocks=args.num_blocks,
        cpu_blocks=0 if label == TARGETS[0] else args.tier_blocks,
        profile="h100-llama8b",
        speed=args.speed,
        scheduling_policy="priority",
        max_num_batched_tokens=8192,
        max_model_len=262_144,
    )
    options = RunOptions(concurrency=64, time_scale=args.time_scale, run_tag=tag, progress=False)
    async with run_simulator_process(sim_cfg) as sim:
        if label != TARGETS[2]:
            target = Target(sim.url, "sim", hints=HintPolicy(mode="none"), api="completions-ids")
            return await run_workload(workload, target, options, label=label), {}
        # kvkeeper on its defaults, with its embedded Redis (no URL), as `kvkeeper serve` runs
        logs = args.out / "logs"
        token = os.environ.setdefault("KVKEEPER_ADMIN_TOKEN", secrets.token_urlsafe(12))
        async with start_kvkeeper([sim], None, logs, retention={}, offload=True) as url:
            if not args.console_shown:
                print(f"console (live while kvkeeper runs): {url}/ui/#token={token}", flush=True)
                args.console_shown = True
            target = Target(url, "sim", hints=HintPolicy(mode="full"), api="completions-ids")
            result = await run_workload(workload, target, options, label=label)
            return result, await _kvkeeper_did(url, logs / "kvkeeper-metrics.txt")


async def demo(args: argparse.Namespace) -> int:
    args.seed = 1 if args.seed is None else args.seed
    args.users = SWARM["users"] if args.users is None else args.users
    args.rounds = ROUNDS if args.rounds is None else args.rounds
    args.out = args.out or Path("results/demo")
    args.time_scale = 0.25 if args.time_scale is None else args.time_scale
    args.console_shown = False
    workload = build_workload("swarm", {**SWARM, "users": args.users, "seed": args.seed})
    if args.num_blocks is None:
        args.num_blocks = pool_blocks(workload, args.time_scale) + 1  # + vLLM's null block
    if args.tier_blocks is None:
        args.tier_blocks = args.num_blocks
    print(
        f"kvkeeper demo: agent swarm ({args.users} users, 6 agents with shared system prompts, tool "
        f"pauses) on a simulated H100 engine with {args.num_blocks} KV blocks "
        f"(half the working set) and a {args.tier_blocks}-block CPU tier; {args.rounds} "
        "round(s), each playing the three stacks in a rotated order",
        flush=True,
    )
    rounds: list[list[RunResult]] = []
    did: dict[str, float] = {}
    for k in range(args.rounds):
        got: dict[int, RunResult] = {}
        for j, i in enumerate(order(k)):
            t0 = time.monotonic()
            print(f"round {k + 1}/{args.rounds}, run {j + 1}/3: {TARGETS[i]}", flush=True)
            got[i], seen = await _one(args, workload, TARGETS[i], f"{time.time()}")
            print(progress(got[i], time.monotonic() - t0), flush=True)
            for name, v in seen.items():
                did[name] = did.get(name, 0.0) + v
        rounds.append([got[i] for i in range(3)])
    finish(rounds, did, args.out, engine_time=True)
    return 0


def run(args: argparse.Namespace) -> int:
    interrupt_on_sigterm()  # unwinds the runs, so the engines and stacks started are stopped
    if args.real:
        from loadgen.demo_real import demo_real

        return asyncio.run(demo_real(args))
    return asyncio.run(demo(args))
