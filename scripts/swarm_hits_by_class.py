"""Where a swarm run's measured hits come from: the agents' anchors or the sessions' own context.

A swarm call's prompt is ``anchor(agent) + task + history``, so of its cached tokens the first
``len(anchor)`` are anchor hits and the rest hits on the session's own context (only possible
when the session calls the same agent again). For every ``round*/<target>.json`` of one or more
``kvkeeper bench compare`` output folders this prints, per target and round, the anchor and
private hit rates and the tokens each class missed::

    python scripts/swarm_hits_by_class.py results/belady/all/swarm-p50 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.workloads.swarm import SwarmParams, build


def anchor_tokens(params: dict[str, Any]) -> dict[str, int]:
    """Each agent's anchor length in tokens, from the workload the run played."""
    workload = build(SwarmParams(**params))
    return {
        call.agent: call.prompt[0].n_tokens
        for session in workload.sessions
        for call in session.calls()
        if call.agent is not None
    }


def split(result: dict[str, Any]) -> dict[str, float]:
    """Anchor and private prompt, hit and missed tokens of one target's run."""
    anchors = anchor_tokens(result["params"])
    out = dict.fromkeys(("anchor", "anchor_hit", "private", "private_hit"), 0)
    for r in result["requests"]:
        if r.get("status") != 200:
            continue
        a = anchors[r["agent"]]
        out["anchor"] += a
        out["anchor_hit"] += min(r["cached_tokens"], a)
        out["private"] += r["prompt_tokens"] - a
        out["private_hit"] += max(0, r["cached_tokens"] - a)
    return {
        **out,
        "anchor_hit_rate": out["anchor_hit"] / max(1, out["anchor"]),
        "private_hit_rate": out["private_hit"] / max(1, out["private"]),
        "hit_rate": (out["anchor_hit"] + out["private_hit"])
        / max(1, out["anchor"] + out["private"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="bench compare output folders")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    print(
        "| run | target | hit | anchor hit | anchor missed tok | private hit | private missed tok |"
    )
    print("|---|---|---|---|---|---|---|")
    for folder in args.dirs:
        for path in sorted(folder.glob("round*/*.json")):
            result = json.loads(path.read_text())
            if (
                not isinstance(result, dict)
                or result.get("workload") != "swarm"
                or "requests" not in result
            ):
                continue
            s = split(result)
            run = f"{folder.name}/{path.parent.name}"
            rows.append({"run": run, "target": path.stem, **s})
            print(
                f"| {run} | `{path.stem}` | {s['hit_rate']:.1%} | {s['anchor_hit_rate']:.1%} | "
                f"{s['anchor'] - s['anchor_hit']:,} | {s['private_hit_rate']:.1%} | "
                f"{s['private'] - s['private_hit']:,} |"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
