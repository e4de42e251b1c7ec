"""``kvkeeper bench compare``: one workload against several targets, each on a fresh engine
(the command line is :mod:`loadgen.compare_cli`).

The targets are the registry in :mod:`loadgen.bench_targets` (``--targets``, default: every
default one that applies). On the simulator every target gets new engine processes with the
same configuration, so no target inherits another's cache; against engine URLs
(``--engine-url``) the prefix cache is reset between targets instead. Beside the measurements
it prints the workload's cache ceilings at the same capacity (:mod:`loadgen.compare_ceilings`):
an infinite cache, Belady's optimal eviction and offline LRU, on the ceiling tool's own timeline
and on the arrival order the first target really saw (the ``realized`` rows).

Every figure "vs base" and the share of the LRU-to-Belady gap closed are measured from one
target's run (``--base``; default ``engine``, else ``round-robin``, else ``none``).
``--pool-frac F`` sizes the pool as ``F`` x the workload's peak working set, split evenly over
replicas. ``--repeats N`` plays the whole comparison N times (``round<k>/`` each; the first
target stays first, the others run in reverse order every other round, so drift hits them
alike) and reports mean and range per figure.

Output in ``--out``: ``<target>.json`` (the run), ``compare.json`` (summaries, ceilings, gaps),
``compare.md`` (the table), ``report.md`` + ``ttft_cdf.png`` + ``hit_rate.png``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.bench_targets import TARGETS, plan_targets, split_target, target_of
from loadgen.compare_ceilings import largest_request_blocks, planned_ceilings, write_oracle
from loadgen.compare_doc import TargetRun, aggregate_rounds, compare_document, engine_work
from loadgen.compare_render import render_aggregate, render_markdown
from loadgen.metrics import counter_delta, parse_counters, summarize
from loadgen.runner import RunOptions, Target, run_workload
from loadgen.sim.server import SimConfig, SimEndpoints
from loadgen.stack import (
    clear_lmcache_l1,
    reset_prefix_cache,
    start_floor,
    start_kvkeeper,
    start_redis,
    start_router,
    start_sims,
)
from loadgen.workloads.base import Workload
from loadgen.workloads.hints import HintPolicy

# kvkeeper's counters kept for the report
EXTRA_COUNTERS = (
    "kvkeeper_touches_total",
    "kvkeeper_expiries_total",
    "kvkeeper_pressure_overrides_total",
    "kvkeeper_prefetches_total",
    "kvkeeper_offloads_total",
)
BELADY_COUNTERS = (
    "kvkeeper_sim_belady_prompt_blocks_total",
    "kvkeeper_sim_belady_unknown_blocks_total",
)
# what the engines did during a target's run (vLLM's names; the simulator exports the same):
# the prompt tokens they looked up, found in the GPU cache, loaded from the offload tier
ENGINE_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "kvkeeper_sim_modelled_seconds_total",  # the simulator's only
    "kvkeeper_sim_lag_seconds_total",
)


@dataclass(frozen=True, slots=True)
class CompareSpec:
    """Everything one comparison needs besides the workload."""

    out: Path
    targets: tuple[str, ...] = ()  # empty: every applicable target
    replicas: int = 1
    sim: SimConfig = field(default_factory=SimConfig)
    pool_frac: float | None = None  # pool = frac x peak working set (else sim.num_blocks)
    engine_urls: tuple[str, ...] = ()  # real engines instead of simulators
    engine_events: tuple[str, ...] = ()
    capacity_blocks: int | None = None  # ceiling capacity for real engines
    options: RunOptions = field(default_factory=RunOptions)
    hints: HintPolicy = field(default_factory=HintPolicy)
    api: str | None = "completions-ids"  # exact token ids: the ceilings see the engine's blocks
    retention: dict[str, Any] = field(default_factory=dict)
    offload: bool = True  # give kvkeeper the simulator's LMCache-shaped tier when it has one
    # the real engines' LMCache MP stack ({coordinator_url, server_url, model_name}): kvkeeper's
    # tier when ``offload``, and its L1 cleared between targets with their prefix caches
    engine_lmcache: Mapping[str, Any] | None = None
    router: str | None = None
    model: str = "sim"
    repeats: int = 1
    base: str | None = None  # the reference of `vs base` and gap closed (None: DEFAULT_BASES)


@contextlib.asynccontextmanager
async def _engines(
    spec: CompareSpec, name: str, oracle: Path | None = None
) -> AsyncIterator[list[SimEndpoints]]:
    """Fresh simulators for target ``name``, or the configured real engines (cache reset)."""
    if spec.engine_urls:
        failed = await reset_prefix_cache(spec.engine_urls)
        if spec.engine_lmcache is not None and not await clear_lmcache_l1(
            str(spec.engine_lmcache["server_url"])
        ):
            failed.append(str(spec.engine_lmcache["server_url"]))
        if failed:
            print(f"warning: prefix cache not reset on {', '.join(failed)}", flush=True)
        events = list(spec.engine_events) + [""] * len(spec.engine_urls)
        yield [
            SimEndpoints(u, e or "", None, None)
            for u, e in zip(spec.engine_urls, events, strict=False)
        ]
        return
    target = target_of(name)
    sim = replace(spec.sim, **target.sim)
    if target.evict_rule:
        assert oracle is not None
        sim = replace(sim, evict_oracle=str(oracle), evict_rule=target.evict_rule)
    async with start_sims(sim, spec.replicas) as sims:
        yield sims


@contextlib.asynccontextmanager
async def _front(name: str, sims: list[SimEndpoints], spec: CompareSpec) -> AsyncIterator[str]:
    """The URL the client talks to for target ``name``, with whatever runs in front."""
    logs = spec.out / "logs"
    base, settings = split_target(name)
    target = TARGETS[base]
    if target.kind == "engine":
        yield sims[0].url
    elif target.kind == "floor":
        async with start_floor(sims[0].url, logs) as url:
            yield url
    elif target.kind == "router":
        assert spec.router is not None and target.router_policy is not None
        urls = [s.url for s in sims]
        async with start_router(spec.router, urls, target.router_policy, logs) as url:
            yield url
    else:
        workers = int(settings.pop("workers", 1))
        share = bool(settings.pop("share", True))
        retention = {
            "block_size": spec.sim.block_size,
            **target.retention,
            **spec.retention,
            **settings,
        }
        usable = [s for s in sims if s.events_endpoint] if spec.engine_urls else sims
        async with (
            start_redis(logs) as redis_url,
            start_kvkeeper(
                usable or sims,
                redis_url,
                logs,
                model=spec.model,
                retention=retention,
                offload=spec.offload,
                workers=workers,
                share=share,
                lmcache=spec.engine_lmcache,
            ) as url,
        ):
            yield url


async def _scrape(
    url: str, keep: Path | None = None, names: Sequence[str] = EXTRA_COUNTERS
) -> dict[str, float]:
    """kvkeeper's counters for the report; the whole exposition is kept in ``keep``."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(url + "/metrics") as resp,
        ):
            if resp.status != 200:
                return {}
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    if keep is not None:
        _write_text(keep, text)
    return parse_counters(text, names)


async def _engine_counters(sims: Sequence[SimEndpoints]) -> dict[str, float]:
    """ENGINE_COUNTERS summed over the engines (those that answer)."""
    total: dict[str, float] = {}
    for counters in await asyncio.gather(*(_scrape(s.url, None, ENGINE_COUNTERS) for s in sims)):
        for k, v in counters.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _write_text(path: Path, text: str) -> None:  # sync, off the coroutine (ruff ASYNC240)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


async def run_target(
    name: str, workload: Workload, spec: CompareSpec, tag: str, timeline: TargetRun | None = None
) -> TargetRun:
    """Bring up a fresh stack for ``name``, play the workload, tear it down; ``timeline``:
    the run whose sends the oracle of ``engine-belady`` (or ``engine-deadfirst``) is taken from."""
    t0 = time.monotonic()
    bench = target_of(name)
    oracle: Path | None = None
    note: str | None = None
    if bench.evict_rule:
        assert timeline is not None and timeline.result is not None
        oracle = spec.out / "logs" / f"{name}-oracle.json"
        blocks = await asyncio.to_thread(
            write_oracle, oracle, workload, timeline.result, spec.sim.hash_seed
        )
        rule = "" if bench.evict_rule == "belady" else ", dead blocks first, then LRU"
        note = f"evicts by the future uses of {timeline.name}'s sends ({blocks:,} blocks{rule})"
    async with _engines(spec, name, oracle) as sims, _front(name, sims, spec) as url:
        target = Target(url, spec.model, replace(spec.hints, mode=bench.hints), api=spec.api)  # type: ignore[arg-type]
        options = replace(spec.options, run_tag=tag)
        before = await _engine_counters(sims)  # real engines count from their start
        result = await run_workload(workload, target, options, label=name)
        engine = engine_work(counter_delta(before, await _engine_counters(sims)))
        keep = spec.out / "logs" / f"{name}-metrics.txt"
        counters = {}
        if bench.kind == "kvkeeper":
            counters = await _scrape(url, keep)
        elif bench.evict_rule:  # the simulator's check that its oracle knew every block
            counters = await _scrape(url, keep, BELADY_COUNTERS)
    result.save(spec.out / f"{name}.json")
    return TargetRun(
        name, result, summarize(result), counters, time.monotonic() - t0, note=note, engine=engine
    )


# --- the comparison ------------------------------------------------------------------------------
def sized_spec(workload: Workload, spec: CompareSpec) -> tuple[CompareSpec, dict[str, Any]]:
    """The spec with the simulator's pool (and block size) set from the ceilings."""
    capacity = spec.capacity_blocks
    if not spec.engine_urls and spec.pool_frac is None:
        capacity = (spec.sim.num_blocks - 1) * spec.replicas  # block 0 is vLLM's null block
    floor = largest_request_blocks(workload) * spec.replicas
    planned = planned_ceilings(workload, spec.options, spec.pool_frac, capacity, floor)
    if spec.engine_urls:
        return spec, planned
    per_replica = max(1, math.ceil(planned["C"] / spec.replicas))
    sim = replace(spec.sim, num_blocks=per_replica + 1, block_size=workload.block_tokens)
    return replace(spec, sim=sim), planned


async def run_compare(workload: Workload, spec: CompareSpec) -> dict[str, Any]:
    """Run every target in turn (``spec.repeats`` rounds); write and return the document."""
    plan = plan_targets(spec.targets, spec.replicas, spec.router, not spec.engine_urls)
    if spec.base is not None and spec.base not in {n for n, skipped in plan if not skipped}:
        raise ValueError(f"--base {spec.base!r} is not one of the targets that run")
    spec.out.mkdir(parents=True, exist_ok=True)
    spec, planned = sized_spec(workload, spec)
    if spec.repeats <= 1:
        return await _run_round(workload, spec, planned, plan, "")
    rounds: list[dict[str, Any]] = []
    for k in range(spec.repeats):
        order = plan if k % 2 == 0 else plan[:1] + plan[:0:-1]
        out = spec.out / f"round{k + 1}"
        label = f"round {k + 1}/{spec.repeats} "
        rounds.append(await _run_round(workload, replace(spec, out=out), planned, order, label))
    doc = aggregate_rounds(rounds, [f"round{k + 1}" for k in range(spec.repeats)])
    (spec.out / "compare.json").write_text(json.dumps(doc, indent=1))
    (spec.out / "compare.md").write_text(render_aggregate(doc))
    return doc


async def _run_round(
    workload: Workload,
    spec: CompareSpec,
    planned: dict[str, Any],
    plan: list[tuple[str, str | None]],
    label: str,
) -> dict[str, Any]:
    spec.out.mkdir(parents=True, exist_ok=True)
    runs: list[TargetRun] = []
    for i, (name, skipped) in enumerate(plan):
        if skipped:
            print(f"{label}[{i + 1}/{len(plan)}] {name}: skipped ({skipped})", flush=True)
            runs.append(TargetRun(name, None, None, {}, 0.0, skipped))
            continue
        print(f"{label}[{i + 1}/{len(plan)}] {name}", flush=True)
        timeline = next((r for r in runs if r.result is not None), None)
        runs.append(await run_target(name, workload, spec, f"t{i}", timeline))
    doc = compare_document(workload, _setup(spec), planned, runs, spec.base)
    (spec.out / "compare.json").write_text(json.dumps(doc, indent=1))
    (spec.out / "compare.md").write_text(render_markdown(doc))
    _render_report(runs, spec.out)
    return doc


def _setup(spec: CompareSpec) -> dict[str, Any]:
    return {
        "replicas": spec.replicas,
        "sim": None if spec.engine_urls else asdict(spec.sim),
        "engine_urls": list(spec.engine_urls),
        "pool_frac": spec.pool_frac,
        "options": asdict(spec.options),
        "hints": asdict(spec.hints),
        "api": spec.api,
        "retention": spec.retention,
        "offload": spec.offload,
    }


def _render_report(runs: list[TargetRun], out: Path) -> None:
    from loadgen.report import render_report

    results = [r.result for r in runs if r.result is not None]
    if results:
        render_report(results, out)
