"""Where each target sent the calls of a multi-replica run, from the recorded response ids.

The simulator starts every response id with its process's tag (``loadgen/sim/api.py``), and
kvkeeper and vllm-router relay bodies unchanged, so the run's ``<target>.json`` says which
replica served each call. Per target this prints the calls, prompt tokens and hit rate per
replica, and how often a session's next call went to another replica than its previous one
(a move: the new replica must build the session's context again).

    python scripts/placement_split.py results/sim_compare/trace-r2-n16-p50 [--targets a,b]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any


def replica_of(record: dict[str, Any]) -> str | None:
    rid = record.get("response_id")
    if not isinstance(rid, str) or "-" not in rid:
        return None
    return rid.split("-", 1)[1][:8]


def split(doc: dict[str, Any]) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    prompt: Counter[str] = Counter()
    cached: Counter[str] = Counter()
    by_session: dict[str, list[tuple[float, str]]] = defaultdict(list)
    unknown = 0
    for r in doc["requests"]:
        rep = replica_of(r)
        if rep is None:
            unknown += 1
            continue
        calls[rep] += 1
        prompt[rep] += r["prompt_tokens"]
        cached[rep] += r["cached_tokens"]
        by_session[r["session_id"]].append((r["t_start"], rep))
    moves = 0
    for seq in by_session.values():
        seq.sort()
        moves += sum(1 for (_, a), (_, b) in pairwise(seq) if a != b)
    return {
        "replicas": {
            rep: {
                "calls": calls[rep],
                "prompt_tokens": prompt[rep],
                "hit_rate": cached[rep] / prompt[rep] if prompt[rep] else None,
            }
            for rep in sorted(calls)
        },
        "sessions": len(by_session),
        "moves": moves,
        "unknown": unknown,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench compare --out folder (or one round of it)")
    ap.add_argument("--targets", default="", help="comma list (default: every <target>.json)")
    args = ap.parse_args()
    wanted = [t for t in args.targets.split(",") if t]
    files = sorted(p for p in args.run.glob("*.json") if p.stem not in ("compare", "summary"))
    for path in files:
        if wanted and path.stem not in wanted:
            continue
        doc = json.loads(path.read_text())
        if "requests" not in doc:
            continue
        s = split(doc)
        parts = ", ".join(
            f"{rep}: {v['calls']} calls, {v['prompt_tokens'] / 1e6:.2f}M tok, "
            f"hit {100 * (v['hit_rate'] or 0):.1f}%"
            for rep, v in s["replicas"].items()
        )
        print(
            f"{path.stem}: {parts}; {s['moves']} moves over {s['sessions']} sessions"
            + (f"; {s['unknown']} calls without a replica tag" if s["unknown"] else "")
        )


if __name__ == "__main__":
    main()
