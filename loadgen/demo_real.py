"""``kvkeeper demo --real``: the demo's three stacks on the real CPU vLLM + LMCache MP stack.

It starts the LMCache MP stack and two vLLM-on-CPU engines (SmolLM2-135M, 32-token blocks):
one attached to LMCache through ``LMCacheMPConnector``, one without (:mod:`loadgen.realstack`).
Each round plays a scaled agent swarm once per stack, each from an empty vLLM prefix cache (and
an empty LMCache L1), in a rotated order:

* ``vLLM``: straight to the plain engine;
* ``vLLM + LMCache``: straight to the LMCache engine;
* ``vLLM + LMCache + kvkeeper``: the LMCache engine behind kvkeeper on its default settings
  (its own redis-server), the LMCache stack as its offload tier, the client sending ``full``
  hints.

The same table and plots as the simulator's demo, in ``results/demo-real/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.bench_compare import run_target
from loadgen.compare_ceilings import largest_request_blocks, planned_ceilings
from loadgen.demo_report import POOL_SHARE, TARGETS, did_from, finish, order, progress
from loadgen.realstack import (
    SETUP_COMMANDS,
    SWARM,
    Engine,
    lmcache_stack,
    missing,
    spec_for,
    vllm_engines,
)
from loadgen.records import RunResult
from loadgen.runner import RunOptions
from loadgen.workloads import build_workload
from loadgen.workloads.base import Workload
from proxy.engine_cli import engine_dtype, ensure_engine_installed

# the real-engine swarm (loadgen.realstack.SWARM) at half its users and sessions of at most 4
# dispatches, to keep the default short (engine start-up dominates)
REAL_SWARM: dict[str, Any] = {**SWARM, "users": 4, "max_dispatches": 4}
REAL_ROUNDS = 1
# room beside the largest call, so two calls fit the pool at once
HEADROOM_BLOCKS = 16
# vLLM refuses a pool smaller than one call of its max model length (4,096 tokens)
MIN_BLOCKS = 4096 // 32


def pool_l1_gb(blocks: int, model_dir: Path, dtype: str) -> str:
    """An LMCache L1 as large as a pool of ``blocks`` blocks of 32 tokens of the model in
    ``model_dir`` (the simulator demo's tier: as large as the pool), in GiB, rounded up."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    width = 4 if dtype in ("float32", "float") else 2
    size = blocks * 32 * 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * width
    return f"{math.ceil(size / 2**30 * 100) / 100:g}"


def real_pool(workload: Workload, time_scale: float) -> int:
    """Half the swarm's peak working set, at least the largest call plus headroom and one call
    of the engine's max model length, plus vLLM's null block."""
    planned = planned_ceilings(workload, RunOptions(time_scale=time_scale), POOL_SHARE, None)
    floor = max(MIN_BLOCKS, largest_request_blocks(workload) + HEADROOM_BLOCKS)
    return max(int(planned["C"]), floor) + 1


async def demo_real(args: argparse.Namespace) -> int:
    gap = missing()
    if gap is not None:
        print(
            f"kvkeeper demo --real: {gap}. Set the real stack up first (once, about 20 min):\n"
            + "\n".join(f"    {c}" for c in SETUP_COMMANDS)
        )
        return 2
    params = {**REAL_SWARM, "seed": REAL_SWARM["seed"] if args.seed is None else args.seed}
    if args.users is not None:
        params["users"] = args.users
    args.rounds = REAL_ROUNDS if args.rounds is None else args.rounds
    time_scale = 1.0 if args.time_scale is None else args.time_scale
    out: Path = args.out or Path("results/demo-real")
    workload = build_workload("swarm", params)
    blocks = args.num_blocks or real_pool(workload, time_scale)
    _, model_dir = ensure_engine_installed()
    l1_gb = args.l1_gb or pool_l1_gb(blocks, model_dir, engine_dtype())
    print(
        f"kvkeeper demo --real: agent swarm ({params['users']} users, {params['agents']} agents "
        f"with shared system prompts, tool pauses x{time_scale:g}) on vLLM-on-CPU (SmolLM2-135M, "
        f"{blocks} KV blocks of 32, at least half the working set) and the LMCache MP server "
        f"(L1 {l1_gb} GB, as large as the pool); {args.rounds} round(s), the three stacks in a "
        "rotated order",
        flush=True,
    )
    t0 = time.monotonic()
    print("starting the LMCache MP stack and two vLLM engines (one to several minutes)", flush=True)
    rounds: list[list[RunResult]] = []
    did: dict[str, float] = {}
    with lmcache_stack(out / "lmcache", l1_gb) as stack:
        tier = stack.tier(model_dir)
        with vllm_engines(blocks, [None, stack.connector()], args.eager) as (plain, lmc):
            print(f"stack up in {time.monotonic() - t0:.0f}s", flush=True)
            plays: list[tuple[str, Engine, dict[str, Any] | None]] = [
                ("engine", plain, None),
                ("engine", lmc, tier),
                ("full", lmc, tier),
            ]
            for k in range(args.rounds):
                got: dict[int, RunResult] = {}
                for j, i in enumerate(order(k)):
                    name, eng, lm = plays[i]
                    print(f"round {k + 1}/{args.rounds}, run {j + 1}/3: {TARGETS[i]}", flush=True)
                    where = out / f"round{k + 1}" / f"stack{i}"
                    spec = spec_for(where, eng, (name,), lm, blocks)
                    spec = replace(spec, options=replace(spec.options, time_scale=time_scale))
                    t1 = time.monotonic()
                    ran = await run_target(name, workload, spec, f"r{k}s{i}{time.time()}")
                    assert ran.result is not None
                    got[i] = replace(ran.result, label=TARGETS[i])
                    print(progress(got[i], time.monotonic() - t1), flush=True)
                    metrics = where / "logs" / f"{name}-metrics.txt"
                    if name == "full" and metrics.is_file():
                        text = await asyncio.to_thread(metrics.read_text)
                        for key, v in did_from(text).items():
                            did[key] = did.get(key, 0.0) + v
                rounds.append([got[i] for i in range(3)])
    finish(rounds, did, out, engine_time=False)  # a real engine's TTFT is its own
    print(f"total {time.monotonic() - t0:.0f}s")
    return 0
