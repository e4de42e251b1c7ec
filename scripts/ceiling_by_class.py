"""Where the cache ceilings' hits come from: blocks many requests share (agent anchors, system
prompts) against blocks few requests use (one session's own context).

Replays a workload's planned timeline (``loadgen.ceiling``) at ``--pool-frac`` of its peak
working set under offline LRU, Belady's optimal eviction and an infinite cache, and splits the
prefix-hit blocks by class: ``shared`` (a block used by at least ``--min-uses`` requests) or
``private``. What Belady wins over LRU in the shared class bounds what any anchor-keeping
policy can win by eviction order alone at that capacity.

    python scripts/ceiling_by_class.py --workload swarm --pool-frac 0.5
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen import ceiling
from loadgen.workloads import build_workload, parse_overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="swarm")
    ap.add_argument("--param", action="append", default=[], help="workload key=value")
    ap.add_argument("--pool-frac", type=float, default=0.5)
    ap.add_argument("--min-uses", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args()

    workload = build_workload(args.workload, parse_overrides(args.param))
    replay = ceiling.layout(workload, "open", 0)
    peak = ceiling.peak_working_set(replay)
    capacity = max(1, round(args.pool_frac * peak))
    uses = Counter(k for r in replay.reqs for k in set(r.keys))

    def classify(key: int) -> str:
        return "shared" if uses[key] >= args.min_uses else "private"

    blocks = Counter(classify(k) for r in replay.reqs for k in r.keys)
    rows = {
        name: ceiling.simulate(replay, cap, policy, classify).hits_by_class
        for name, policy, cap in (
            ("lru", "lru", capacity),
            ("belady", "belady", capacity),
            ("infinite", "lru", 2 * peak),  # room for everything: nothing is ever evicted
        )
    }
    total = sum(blocks.values())
    print(f"{args.workload}: C = {capacity} blocks ({args.pool_frac:g} x peak {peak}), ", end="")
    print(f"{total:,} prompt blocks: " + ", ".join(f"{c} {n:,}" for c, n in blocks.items()))
    print("| policy | hit rate | " + " | ".join(f"{c} hit blocks" for c in blocks) + " |")
    print("|---|---|" + "---|" * len(blocks))
    for name, hits in rows.items():
        cells = " | ".join(f"{hits.get(c, 0):,}" for c in blocks)
        print(f"| {name} | {sum(hits.values()) / total:.1%} | {cells} |")
    if args.out is not None:
        doc = {"capacity": capacity, "peak": peak, "blocks": blocks, "hits": rows}
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
