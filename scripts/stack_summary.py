#!/usr/bin/env python3
"""kvkeeper's whole one-replica stack against vanilla vLLM, per setting, from tier runs:

    BASE=engine-notier REPEATS=1 \\
      TARGETS="engine-notier,engine-belady,engine,full+priority@tier_pin_share=1.0" \\
      bash scripts/bench_sim_compare.sh DIR          # the -tier settings (ONLY=...)
    python scripts/stack_summary.py DIR [DIR ...]    # one round per DIR (or roundN/ inside)

Per setting, the mean over every round found and the per-round values in brackets: hit rate
against vanilla vLLM without a tier (``engine-notier``); the share of the gap to the pool's
Belady closed, to the realized Belady held from the send and to the one held from the first
token (what the ``engine-belady`` engine reaches); mean TTFT against vanilla vLLM and against
``engine-belady``; p90 TTFT against vanilla; retention recompute. Rows: ``engine-belady`` (eviction
alone), ``engine`` (plain LMCache, the tier without kvkeeper) and the kvkeeper target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.compare_ceilings import gap_closed

VANILLA, BELADY = "engine-notier", "engine-belady"
SETTINGS = (
    "trace-n8-p25-tier",
    "trace-n8-p50-tier",
    "trace-n16-p25-tier",
    "trace-n16-p50-tier",
    "swarm-p50-tier",
    "fanout-p50-tier",
    "trace-n8-p25-tier2x",
    "trace-n16-p25-tier2x",
)


def rounds(roots: list[Path], setting: str) -> list[dict[str, Any]]:
    """Every single-round compare.json of ``setting`` under ``roots``."""
    docs = []
    for root in roots:
        top = root / setting / "compare.json"
        paths = sorted((root / setting).glob("round*/compare.json")) if top.exists() else []
        if top.exists() and not paths:
            paths = [top]
        docs += [json.loads(p.read_text()) for p in paths]
    return docs


def figures(doc: dict[str, Any], name: str) -> dict[str, float | None] | None:
    """One target's figures of one round, recomputed against the round's vanilla engine."""
    targets = doc["targets"]
    t, v, b = targets.get(name), targets.get(VANILLA), targets.get(BELADY)
    if not t or "skipped" in t or not v or "skipped" in v:
        return None
    hit, base = t["hit_rate"], v["hit_rate"]
    sent, first_token = doc["ceilings"]["realized"], doc["ceilings"].get("admitted")
    return {
        "hit": hit,
        "pp": 100 * (hit - base),
        "gap": gap_closed(hit, base, sent["belady"]) if sent else None,
        "gap_ft": gap_closed(hit, base, first_token["belady"]) if first_token else None,
        "ttft": t["ttft"]["mean"] / v["ttft"]["mean"] - 1,
        "p90": t["ttft"]["p90"] / v["ttft"]["p90"] - 1,
        "vs_belady": (
            t["ttft"]["mean"] / b["ttft"]["mean"] - 1 if b and "skipped" not in b else None
        ),
        "recompute": t.get("retention_recomputed_share"),
    }


def cell(values: list[float | None], fmt: str, scale: float = 100.0) -> str:
    got = [scale * x for x in values if x is not None]
    if not got:
        return "-"
    mean = fmt.format(sum(got) / len(got))
    return mean if len(got) == 1 else f"{mean} ({', '.join(fmt.format(x) for x in got)})"


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path("results/stack")]
    print(
        "| setting | target | hit rate | vs vanilla | gap closed (send) | gap closed (first token) "
        "| mean TTFT vs vanilla | vs engine-belady | p90 TTFT vs vanilla | retention recompute |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setting in SETTINGS:
        docs = rounds(roots, setting)
        if not docs:
            continue
        vanilla = [d["targets"][VANILLA] for d in docs if VANILLA in d["targets"]]
        hits = [v["hit_rate"] for v in vanilla]
        ttfts = [v["ttft"]["mean"] for v in vanilla]
        print(
            f"| {setting} ({len(docs)} rounds) | {VANILLA} | {cell(hits, '{:.1f}%')} | - | - | - "
            f"| {cell(ttfts, '{:.3f}', 1.0)} s | - | - | - |"
        )
        names = [n for n in docs[0]["targets"] if n != VANILLA]
        for name in names:
            figs = [f for d in docs if (f := figures(d, name)) is not None]
            if not figs:
                continue

            def col(key: str, fmt: str, scale: float = 100.0, figs: list[Any] = figs) -> str:
                return cell([f[key] for f in figs], fmt, scale)

            print(
                f"| | {name} | {col('hit', '{:.1f}%')} | {col('pp', '{:+.1f}', 1.0)} pp "
                f"| {col('gap', '{:.0f}%')} | {col('gap_ft', '{:.0f}%')} "
                f"| {col('ttft', '{:+.1f}%')} | {col('vs_belady', '{:+.1f}%')} "
                f"| {col('p90', '{:+.1f}%')} | {col('recompute', '{:.2f}%')} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
