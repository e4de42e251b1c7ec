#!/usr/bin/env python3
"""The summary table of BENCHMARKS.md's simulator section, from ``bench_sim_compare.sh`` results.

    python scripts/sim_compare_summary.py [results/sim_compare] [--per-setting]

Settings run with ``--repeats`` (``REPEATS=N bash scripts/bench_sim_compare.sh``) get a table of
their own: mean and range over rounds of every figure, the paired difference to each round's
baseline included.

One row per setting and ``full`` target (two replicas: also ``none`` and
``vllm-router``): hit rate against the baseline (``engine``; ``round-robin`` with two replicas)
and the realized ceilings, the share of the LRU-to-Belady gap
closed, mean / p90 TTFT against the baseline, and retention overhead. Also the run-to-run noise
of a one-replica setting: ``none`` minus ``engine`` (kvkeeper without hints sends the same
requests); with two replicas ``none`` is kvkeeper's own placement and gets its own row.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TITLES = {
    "trace-n8-p25": "Claude Code traces, 8 sessions, pool 25% of W",
    "trace-n8-p50": "Claude Code traces, 8 sessions, pool 50% of W",
    "trace-n16-p25": "Claude Code traces, 16 sessions, pool 25% of W",
    "trace-n16-p50": "Claude Code traces, 16 sessions, pool 50% of W",
    "swarm-p50": "swarm (CacheScout setting), one replica, pool 50% of W",
    "fanout-p50": "fanout (the RFC's fan-out/join), one replica, pool 50% of W",
    "swarm-r2-p50": "swarm, two replicas (pool 50% of W split over them)",
    "trace-n8-p25-tier": "Claude Code traces, 8 sessions, pool 25% of W, CPU tier of the pool's size",
    "swarm-p50-tier": "swarm, one replica, pool 50% of W, CPU tier of the pool's size",
}
ORDER = tuple(TITLES)


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x * 100:+.1f}%" if signed else f"{x * 100:.1f}%"


def _fig(fig: dict[str, Any] | None, scale: float = 100.0, fmt: str = "{:.1f}%") -> str:
    """``mean (min to max)`` of an aggregated figure (``bench compare --repeats``)."""
    if fig is None:
        return "-"
    f = [fmt.format(scale * fig[k]) for k in ("mean", "min", "max")]
    return f"{f[0]} ({f[1]} to {f[2]})"


def _settings(root: Path, repeated: bool) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(setting, compare.json)`` in BENCHMARKS order: those run with ``--repeats`` or not."""
    for name in ORDER:
        path = root / name / "compare.json"
        if path.exists():
            doc: dict[str, Any] = json.loads(path.read_text())
            if ("repeats" in doc) == repeated:
                yield name, doc


def rows_repeated(root: Path) -> list[str]:
    """The summary of settings run with ``--repeats``: mean and range over rounds."""
    out = [
        "| setting | target | rounds | C / W blocks | base hit | hit | hit vs base (pp) "
        "| realized Belady - base (pp) | gap closed | noise: none vs base (pp) "
        "| TTFT mean vs base | retention recomputed share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, doc in _settings(root, repeated=True):
        targets = doc["targets"]
        base_name = next((b for b in ("engine", "round-robin", "none") if b in targets), None)
        if base_name is None:
            continue
        # each round's realized Belady over that round's baseline hit rate (both in the document)
        base_hits = targets[base_name]["hit_rate"]["values"]
        realized = doc["ceilings"]["realized"]
        gaps = [100 * (r["belady"] - h) for r, h in zip(realized, base_hits, strict=True)]
        gap = {"mean": sum(gaps) / len(gaps), "min": min(gaps), "max": max(gaps)}
        one = base_name == "engine"
        noise = targets.get("none", {}).get("hit_rate_vs_base_pp") if one else None
        shown = [t for t in targets if t != base_name and not (one and t == "none")]
        for tname in shown:
            t = targets[tname]
            if "skipped" in t:
                continue
            out.append(
                f"| {name} | {tname} | {doc['repeats']} "
                f"| {doc['ceilings']['planned']['C']:,} / {doc['ceilings']['planned']['peak_ws']:,} "
                f"| {_fig(targets[base_name].get('hit_rate'))} "
                f"| {_fig(t.get('hit_rate'))} | {_fig(t.get('hit_rate_vs_base_pp'), 1, '{:+.1f}')} "
                f"| {_fig(gap, 1, '{:.1f}')} | {_fig(t.get('gap_closed'))} "
                f"| {_fig(noise, 1, '{:+.1f}')} "
                f"| {_fig(t.get('ttft_mean_vs_base'), 100, '{:+.1f}%')} "
                f"| {_fig(t.get('retention_recomputed_share'))} |"
            )
    return out


def rows(root: Path) -> list[str]:
    out = [
        "| setting | target | C / W blocks | base hit | hit | realized LRU / Belady / inf "
        "| gap closed | noise: none - base hit | TTFT mean vs base | TTFT p90 vs base "
        "| retention sent / recomputed share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, doc in _settings(root, repeated=False):
        targets = doc["targets"]
        base_name = "engine" if "engine" in targets else "round-robin"
        base = targets.get(base_name)
        if base is None:
            continue
        real = doc["ceilings"]["realized"]
        planned = doc["ceilings"]["planned"]
        # one replica: `none` sends what `engine` sends, so their difference is noise; with two,
        # `none` is kvkeeper's own placement against round robin, and gets a row of its own
        one = base_name == "engine"
        noise = (
            (targets["none"]["hit_rate"] - base["hit_rate"]) * 100
            if one and "none" in targets
            else None
        )
        names = ("full",) if one else ("none", "full", "vllm-router")
        for tname in names:
            t = targets.get(tname)
            if t is None:
                continue
            gap = real["belady"] - base["hit_rate"]
            closed = (t["hit_rate"] - base["hit_rate"]) / gap if gap > 0 else None
            out.append(
                f"| {name} | {tname} | {real['C']:,} / {planned['peak_ws']:,} "
                f"| {_pct(base['hit_rate'])} | {_pct(t['hit_rate'])} "
                f"| {_pct(real['lru'])} / {_pct(real['belady'])} / {_pct(real['inf'])} "
                f"| {_pct(closed)} | {'-' if noise is None else f'{noise:+.1f} pp'} "
                f"| {_pct(t['ttft_mean_vs_base'], True)} | {_pct(t['ttft_p90_vs_base'], True)} "
                f"| {_pct(t['retention_prompt_share'])} / {_pct(t['retention_recomputed_share'])} |"
            )
    return out


def per_setting(root: Path) -> list[str]:
    """Each setting's ``compare.md`` under its BENCHMARKS.md heading."""
    out: list[str] = []
    for name in ORDER:
        path = root / name / "compare.md"
        if not path.exists():
            continue
        doc = json.loads((root / name / "compare.json").read_text())
        if "repeats" in doc:  # the round tables, not the aggregate: C is the planned pool
            out += [f"#### {TITLES[name]}", "", f"`results/sim_compare/{name}/`:"]
            out += [*path.read_text().strip().splitlines()[1:], ""]
            continue
        real, planned = doc["ceilings"]["realized"], doc["ceilings"]["planned"]
        body = path.read_text().strip().splitlines()[1:]  # its own title line is ours here
        out += [
            f"#### {TITLES[name]}",
            "",
            f"`results/sim_compare/{name}/` (C = {real['C']:,} blocks, W = {planned['peak_ws']:,}):",
            *body,
            "",
        ]
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    root = Path(args[0] if args else "results/sim_compare")
    if "--per-setting" in sys.argv:
        lines = per_setting(root)
    else:
        lines = rows(root)
        repeated = rows_repeated(root)
        if len(repeated) > 2:  # header rows only: no setting of that kind
            lines = [*lines, "", *repeated] if len(lines) > 2 else repeated
    print("\n".join(lines))


if __name__ == "__main__":
    main()
