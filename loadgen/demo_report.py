"""The demo's report: the three stacks side by side (hit rate and tokens pooled over the rounds,
TTFT the median of the rounds), what kvkeeper did, the rotated run order. Shared by the
simulator demo (:mod:`loadgen.demo_cli`) and ``--real`` (:mod:`loadgen.demo_real`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.metrics import parse_counters, summarize
from loadgen.records import RunResult
from loadgen.report import render_report

POOL_SHARE = 0.5
TARGETS = ("vLLM", "vLLM + LMCache", "vLLM + LMCache + kvkeeper")
# what kvkeeper did, from its /metrics at the end of its run
DID = {
    "touches": ("kvkeeper_touches_total", {"outcome": ("ok", "late")}),  # served, on time or not
    "tier pins": ("kvkeeper_offloads_total", None),
    "prefetches": ("kvkeeper_prefetches_total", None),
    "evictions": ("kvkeeper_evictions_total", None),
    "guard back-offs": ("kvkeeper_retention_guard_backoffs_total", None),
}


def did_from(text: str) -> dict[str, float]:
    """What kvkeeper did (touches served, pins, ...), from its /metrics exposition."""
    did: dict[str, float] = {}
    for label, (name, only) in DID.items():
        if only is None:
            did[label] = parse_counters(text, [name]).get(name, 0.0)
            continue
        lines = [
            ln
            for ln in text.splitlines()
            if ln.startswith(name)
            and all(any(f'{k}="{v}"' in ln for v in values) for k, values in only.items())
        ]
        did[label] = parse_counters("\n".join(lines), [name]).get(name, 0.0)
    return did


def progress(result: RunResult, took: float) -> str:
    s = summarize(result)
    return (
        f"  {took:.0f}s: {s['requests']} calls, hit rate {s['hit_rate'] * 100:.1f}%, "
        f"mean TTFT {s['ttft']['mean'] * 1e3:.0f} ms"
    )


def order(k: int) -> tuple[int, ...]:
    """Round ``k``'s order of the three stacks: rotated, so over three rounds each stack runs
    first, second and third once and the machine's drift falls on all three alike."""
    return tuple((k + i) % len(TARGETS) for i in range(len(TARGETS)))


def merged(label: str, runs: Sequence[RunResult]) -> RunResult:
    """One stack's rounds as one run (sessions renamed per round), for the pooled report."""
    first = runs[0]
    requests, manages, sessions = [], [], []
    counters: dict[str, float] = {}
    for k, r in enumerate(runs):
        requests += [replace(x, session_id=f"r{k + 1}/{x.session_id}") for x in r.requests]
        manages += [replace(x, session_id=f"r{k + 1}/{x.session_id}") for x in r.manages]
        sessions += [
            replace(
                x,
                session_id=f"r{k + 1}/{x.session_id}",
                parent_id=x.parent_id and f"r{k + 1}/{x.parent_id}",
            )
            for x in r.sessions
        ]
        for name, v in (r.kvkeeper or {}).items():
            counters[name] = counters.get(name, 0.0) + v
    return replace(
        first,
        duration=sum(r.duration for r in runs),
        requests=requests,
        manages=manages,
        sessions=sessions,
        kvkeeper=counters if first.kvkeeper is not None else None,
        label=label,
    )


def _median(xs: Sequence[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else float("nan")


def _row(name: str, s: dict[str, Any], ttfts: Sequence[float], rounds: int) -> str:
    over = s.get("retention_recomputed_tokens")
    share = (over or 0) / max(1, s["prompt_tokens"])
    return (
        f"| {name} | {s['hit_rate'] * 100:.1f}% | "
        + "".join(f"{t * 1e3:.0f} ms | " for t in ttfts)
        + f"{s['recomputed_prompt_tokens'] / rounds:,.0f} | "
        f"{'-' if over is None else f'{over / rounds:,.0f} ({share * 100:.2f}%)'} |"
    )


def table(
    rounds: Sequence[Sequence[RunResult]], did: dict[str, float], engine_time: bool = True
) -> str:
    """The three stacks side by side: hit rate and tokens pooled over the rounds (tokens per
    round), TTFT the median of the rounds' means and p90s (and, on the simulator, of the mean
    engine-time TTFT); then each round's means."""
    per_round = [[summarize(r) for r in rnd] for rnd in rounds]
    pooled = [summarize(merged(TARGETS[i], [rnd[i] for rnd in rounds])) for i in range(3)]
    n = len(rounds)
    cols = [("mean TTFT", "ttft", "mean"), ("p90 TTFT", "ttft", "p90")]
    if engine_time:
        cols.append(("mean TTFT, engine time", "ttft_engine_time", "mean"))
    med = [
        [_median([pr[i][key][stat] for pr in per_round]) for _, key, stat in cols] for i in range(3)
    ]
    lines = [
        "| target | prefix-cache hit rate | "
        + "".join(f"{title} (median of {n}) | " for title, _, _ in cols)
        + "recomputed prompt tokens per round | retention overhead per round (recomputed) |",
        "|" + "---|" * (len(cols) + 4),
    ]
    lines += [_row(TARGETS[i], pooled[i], med[i], n) for i in range(3)]
    lines.append("")
    for r, pr in enumerate(per_round):
        ran = ", ".join(TARGETS[i] for i in order(r))
        got = " / ".join(f"{pr[i]['ttft']['mean'] * 1e3:.0f}" for i in range(3))
        lines.append(f"round {r + 1} (run order: {ran}): mean TTFT {got} ms (in the table's order)")
    k = pooled[2]
    for i, name in enumerate(TARGETS[:2]):
        b = pooled[i]
        ratios = ", ".join(
            f"{title} {med[2][c] / med[i][c]:.2f}x" for c, (title, _, _) in enumerate(cols)
        )
        lines.append(
            f"kvkeeper vs {name}: hit rate {(k['hit_rate'] - b['hit_rate']) * 100:+.1f} pp, "
            f"{ratios}, recomputed tokens "
            f"{k['recomputed_prompt_tokens'] / max(1, b['recomputed_prompt_tokens']):.2f}x"
        )
    for c in range(1 + engine_time):
        title, key, _ = cols[2 * c]  # mean TTFT, then mean engine-time TTFT
        ahead = all(
            k["hit_rate"] > pooled[i]["hit_rate"] and med[2][2 * c] < med[i][2 * c]
            for i in range(2)
        )
        won = sum(
            all(pr[2][key]["mean"] < pr[i][key]["mean"] for i in range(2)) for pr in per_round
        )
        lines.append(
            f"kvkeeper ahead of both (hit rate and median {title}): "
            + ("yes" if ahead else "NO")
            + f"; lowest {title} in {won} of {n} rounds"
        )
    if engine_time:
        lines.append(
            "TTFT: wall clock at the client; engine time: the engine's part at its profile's speed "
            "(the simulator runs faster), the rest at wall time (docs/benchmarks.md)"
        )
    if did:
        lines.append("what kvkeeper did: " + ", ".join(f"{d} {v:,.0f}" for d, v in did.items()))
    return "\n".join(lines)


def finish(
    rounds: Sequence[Sequence[RunResult]], did: dict[str, float], out: Path, engine_time: bool
) -> None:
    """Print the table; write the pooled report and plots (one curve per stack) into ``out``."""
    for k, rnd in enumerate(rounds):
        for r in rnd:
            r.save(out / f"round{k + 1}" / f"{TARGETS.index(r.label)}.json")
    stacks = [merged(TARGETS[i], [rnd[i] for rnd in rounds]) for i in range(3)]
    report = render_report(stacks, out)
    print()
    print(table(rounds, did, engine_time))
    print(f"\nreport: {report}  plots: {out / 'ttft_cdf.png'}, {out / 'hit_rate.png'}")
