"""``kvkeeper demo``: vanilla vLLM, vLLM + plain LMCache, and vLLM + LMCache + kvkeeper, side by side.

It starts the engine simulator (a vLLM-exact block pool under cache pressure, Llama-3.1-8B on
one H100 timing) three times and plays the same agent swarm against each: a supervisor and
specialised workers whose long system prompts (anchors) every user session shares, with tool
pauses between turns. The pool holds half the swarm's peak working set.

* ``vLLM``: straight to the engine, no offload tier (an agent framework without kvkeeper);
* ``vLLM + LMCache``: the same engine with an LMCache-shaped CPU tier as large as the pool
  (written through, LRU), still straight to it;
* ``vLLM + LMCache + kvkeeper``: the same engine and tier behind ``kvkeeper serve`` on its
  default settings (embedded Redis), the client sending the hints a well-integrated framework
  sends (session and parent ids, a TTL across each tool pause, evict when done, prefetch before
  a resume). kvkeeper finds the tier and the engine's scheduling policy by itself.

Every engine runs ``--scheduling-policy priority``; requests that carry no priority are served
first come, first served, so the two baselines see plain vLLM. It prints the three side by side
with what kvkeeper did, and writes ``results/demo/`` (report.md, summary.json, PNGs). Nothing
is faked: every column is measured in this run. ``--real`` runs the same three on the real CPU
vLLM + LMCache MP stack (``kvkeeper engine setup`` first).
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

from loadgen.extras import needs_bench
from loadgen.metrics import parse_counters, summarize
from loadgen.records import RunResult
from loadgen.report import render_report
from loadgen.runner import RunOptions, Target, run_workload
from loadgen.sim import SimConfig, run_simulator_process
from loadgen.stack import start_kvkeeper
from loadgen.workloads import build_workload
from loadgen.workloads.hints import HintPolicy

# The swarm benchmark's setting (BENCHMARKS.md, swarm-p50-tier) at half its wall time: 24 users,
# 6 agents with 2-8K-token anchors; pauses x0.25 on a simulator 4x faster keep the timeline's
# shape in the engine's modelled time. The pool is half the peak working set (blocks of 32),
# the tier as large.
SWARM: dict[str, Any] = {"users": 24}
POOL_BLOCKS = 1192
TIER_BLOCKS = 1192
TARGETS = ("vLLM", "vLLM + LMCache", "vLLM + LMCache + kvkeeper")
# what kvkeeper did, from its /metrics at the end of its run
DID = {
    "touches": ("kvkeeper_touches_total", {"outcome": "ok"}),
    "tier pins": ("kvkeeper_offloads_total", None),
    "prefetches": ("kvkeeper_prefetches_total", None),
    "evictions": ("kvkeeper_evictions_total", None),
    "guard back-offs": ("kvkeeper_retention_guard_backoffs_total", None),
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="vanilla vLLM, vLLM + LMCache and vLLM + LMCache + kvkeeper on one swarm, side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, default=Path("results/demo"), help="where to write the report"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--users", type=int, default=SWARM["users"])
    p.add_argument(
        "--num-blocks", type=int, default=POOL_BLOCKS, help="simulated KV pool (blocks of 32)"
    )
    p.add_argument(
        "--tier-blocks", type=int, default=TIER_BLOCKS, help="the LMCache-shaped CPU tier"
    )
    p.add_argument("--time-scale", type=float, default=0.25, help="multiplies tool pauses")
    p.add_argument(
        "--speed", type=float, default=4.0, help="simulator speed-up over the h100-llama8b profile"
    )
    p.set_defaults(func=needs_bench("kvkeeper demo", run))


async def _kvkeeper_did(url: str, keep: Path) -> dict[str, float]:
    """What kvkeeper did over its run, from its /metrics (touches served, pins, ...); the whole
    exposition is kept in ``keep``."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(url + "/metrics") as resp,
        ):
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    await asyncio.to_thread(keep.write_text, text)
    did: dict[str, float] = {}
    for label, (name, only) in DID.items():
        if only is None:
            did[label] = parse_counters(text, [name]).get(name, 0.0)
            continue
        lines = [
            ln
            for ln in text.splitlines()
            if ln.startswith(name) and all(f'{k}="{v}"' in ln for k, v in only.items())
        ]
        did[label] = parse_counters("\n".join(lines), [name]).get(name, 0.0)
    return did


async def _one(args: argparse.Namespace, label: str) -> tuple[RunResult, dict[str, float]]:
    workload = build_workload("swarm", {**SWARM, "users": args.users, "seed": args.seed})
    sim_cfg = SimConfig(
        num_blocks=args.num_blocks,
        cpu_blocks=0 if label == TARGETS[0] else args.tier_blocks,
        profile="h100-llama8b",
        speed=args.speed,
        scheduling_policy="priority",
        max_num_batched_tokens=8192,
        max_model_len=262_144,
    )
    options = RunOptions(
        concurrency=64, time_scale=args.time_scale, run_tag=str(time.time()), progress=False
    )
    async with run_simulator_process(sim_cfg) as sim:
        if label != TARGETS[2]:
            target = Target(sim.url, "sim", hints=HintPolicy(mode="none"), api="completions-ids")
            return await run_workload(workload, target, options, label=label), {}
        # kvkeeper on its defaults, with its embedded Redis (no URL), as `kvkeeper serve` runs
        logs = args.out / "logs"
        token = os.environ.setdefault("KVKEEPER_ADMIN_TOKEN", secrets.token_urlsafe(12))
        async with start_kvkeeper([sim], None, logs, retention={}, offload=True) as url:
            print(f"console (live while this run lasts): {url}/ui/#token={token}", flush=True)
            target = Target(url, "sim", hints=HintPolicy(mode="full"), api="completions-ids")
            result = await run_workload(workload, target, options, label=label)
            return result, await _kvkeeper_did(url, logs / "kvkeeper-metrics.txt")


def _row(name: str, s: dict[str, Any]) -> str:
    ttft, engine_time = s["ttft"], s["ttft_engine_time"]
    over = s.get("retention_recomputed_tokens")
    share = (over or 0) / max(1, s["prompt_tokens"])
    return (
        f"| {name} | {s['hit_rate'] * 100:.1f}% | {ttft['mean'] * 1e3:.0f} ms | "
        f"{ttft['p90'] * 1e3:.0f} ms | {engine_time['mean'] * 1e3:.0f} ms | "
        f"{s['recomputed_prompt_tokens']:,} | "
        f"{'-' if over is None else f'{over:,.0f} ({share * 100:.2f}%)'} |"
    )


def table(results: list[RunResult], did: dict[str, float]) -> str:
    lines = [
        "| target | prefix-cache hit rate | mean TTFT | p90 TTFT | mean TTFT, engine time "
        "| recomputed prompt tokens | retention overhead (recomputed) |",
        "|---|---|---|---|---|---|---|",
    ]
    s = [summarize(r) for r in results]
    lines += [_row(r.label, x) for r, x in zip(results, s, strict=True)]
    if len(s) == 3 and s[0]["ttft"]["mean"] and s[1]["ttft"]["mean"]:
        k = s[2]
        for name, base in (("vLLM", s[0]), ("vLLM + LMCache", s[1])):
            lines.append(
                f"\nkvkeeper vs {name}: hit rate {(k['hit_rate'] - base['hit_rate']) * 100:+.1f} pp, "
                f"mean TTFT {k['ttft']['mean'] / base['ttft']['mean']:.2f}x, "
                f"p90 TTFT {k['ttft']['p90'] / base['ttft']['p90']:.2f}x, recomputed tokens "
                f"{k['recomputed_prompt_tokens'] / max(1, base['recomputed_prompt_tokens']):.2f}x"
            )
        ahead = all(
            k["hit_rate"] > b["hit_rate"] and k["ttft"]["mean"] < b["ttft"]["mean"] for b in s[:2]
        )
        lines.append(
            "kvkeeper ahead of both (hit rate and mean TTFT): " + ("yes" if ahead else "NO")
        )
    lines.append(
        "TTFT: wall clock at the client; engine time: the engine's part at its profile's speed "
        "(the simulator runs faster), the rest at wall time (docs/benchmarks.md)"
    )
    if did:
        lines.append("what kvkeeper did: " + ", ".join(f"{k} {v:,.0f}" for k, v in did.items()))
    return "\n".join(lines)


async def demo(args: argparse.Namespace) -> int:
    print(
        f"kvkeeper demo: agent swarm ({args.users} users, 6 agents with shared anchors, tool "
        f"pauses) on a simulated H100 engine with {args.num_blocks} KV blocks "
        f"(half the working set) and a {args.tier_blocks}-block CPU tier",
        flush=True,
    )
    results: list[RunResult] = []
    did: dict[str, float] = {}
    for i, label in enumerate(TARGETS):
        print(f"run {i + 1}/3: {label}", flush=True)
        result, got = await _one(args, label)
        results.append(result)
        did = got or did
    report = render_report(results, args.out)
    print()
    print(table(results, did))
    print(f"\nreport: {report}  plots: {args.out / 'ttft_cdf.png'}, {args.out / 'hit_rate.png'}")
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(demo(args))
