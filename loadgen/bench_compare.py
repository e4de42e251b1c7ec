"""``kvkeeper bench compare``: one workload against several targets, each on a fresh engine.

Targets (``--targets``, default: every one that applies):

* ``engine``: straight to the engine: vanilla vLLM LRU (one replica only);
* ``none`` / ``session`` / ``full``: through kvkeeper, the client sending that hint mode
  (:mod:`loadgen.workloads.hints`);
* ``full+dispatch``: ``full``, with kvkeeper's cache-aware dispatch on (``dispatch_ahead`` 2,
  :mod:`proxy.dispatch`): the engine's queue kept short, fewest uncached tokens first;
* ``full+unbounded`` (only when named): ``full`` with no retention overhead budget
  (``max_overhead_share`` None, :mod:`policy.overhead`): touches and warm-ups recompute
  whatever they need;
* ``none+priority`` / ``full+priority`` (only when named): ``none`` / ``full`` with kvkeeper's
  cache-aware admission order (``admission_priority``, :mod:`policy.admission`) on engines run
  with ``--scheduling-policy priority`` (whatever ``--scheduling-policy`` the others get);
* ``engine-notier`` / ``full+pins`` (only when named, for runs with ``--cpu-blocks``):
  ``engine`` on simulators without the CPU tier (what the tier itself adds), and ``full`` with
  tier pins (``tier_pin_share`` 0.5, :mod:`proxy.tiers`: protected sessions the GPU is losing
  pinned in the tier); ``full+tiercover``: ``full`` with ``tier_skip_touches`` (no touches for
  protected sessions the tier will still hold when their protection ends);
* ``engine-belady`` (only when named, simulator, one replica): ``engine`` evicting by Belady's
  rule from the future uses the round's first target really made (:mod:`loadgen.sim.belady`),
  with no CPU tier: the best that eviction order alone does, in TTFT as well as hit rate
  (``ttft_mean_vs_belady``: every target's mean TTFT against it);
* ``full+step-deadline`` (only when named): ``full`` with the touch deadline stretched to three
  of the engine's steps where they outlast ``touch_deadline_s`` (``touch_deadline_steps`` 3);
* ``round-robin`` / ``vllm-router``: with several replicas, ``vllm-router`` (PyPI) with its
  ``round_robin`` and its ``cache_aware`` policy, when installed.

A kvkeeper target may carry settings of its own after ``@``: ``full+pins@tier_pin_share=0.8``
is ``full+pins`` with that retention setting (several: ``@a=1@b=2``; they win over
``--retention``), so one invocation can play one mechanism at several settings side by side.

On the simulator every target gets new engine processes with the same configuration, so no
target inherits another's cache; against engine URLs (``--engine-url``) the prefix cache is
reset between targets instead. Beside the measurements it prints the workload's cache ceilings
at the same capacity (:mod:`loadgen.ceiling`): an infinite cache, Belady's optimal eviction and
offline LRU, computed twice: on the ceiling tool's own timeline and on the arrival order the
first target really saw (the ``realized`` rows; their LRU cross-checks the simulator).

Every figure "vs base" and the share of the LRU-to-Belady gap closed are measured from one
target's run (``--base``; default ``engine``, else ``round-robin``, else ``none``; with a CPU
tier ``engine`` is plain LMCache, and ``--base engine-notier`` measures against vanilla vLLM
without it). The gap runs to the realized Belady twice: blocks held from each call's send, and
held from its first token as the engine holds them (a request in its queue holds none), the
ceiling an engine evicting by Belady's rule reaches.

``--pool-frac F`` sizes the pool as ``F`` x the workload's peak working set (its ``slots``
layout with ``--max-sessions`` root sessions open, else ``open``), split evenly over replicas.

Output in ``--out``: ``<target>.json`` (the run), ``compare.json`` (summaries, ceilings, gaps),
``compare.md`` (the table), ``report.md`` + ``ttft_cdf.png`` + ``hit_rate.png``.

``--repeats N`` plays the whole comparison N times (``round<k>/`` each, with its own realized
ceilings; the first target stays first so the realized timeline is always the same target's,
the others run in reverse order every other round, so drift hits them alike). The top-level
``compare.json`` / ``compare.md`` then give per target the mean and the range over rounds of
each figure, the paired difference to the baseline included: on a shared machine one run's
timing moves hit rates by points, so a gain is a result only where every round shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from loadgen import ceiling, tokens
from loadgen.bench_cli import _add_workload_args, workload_from_args
from loadgen.metrics import counter_delta, parse_counters, summarize
from loadgen.runner import RequestRecord, RunOptions, RunResult, Target, run_workload
from loadgen.sim.belady import EvictRule, oracle_document
from loadgen.sim.engine import SCHEDULING_POLICIES
from loadgen.sim.kv_manager import BlockHashCache
from loadgen.sim.kv_manager import Sequence as SimSequence
from loadgen.sim.profiles import PROFILES
from loadgen.sim.server import SimConfig, SimEndpoints
from loadgen.targets import (
    find_router,
    reset_prefix_cache,
    start_kvkeeper,
    start_redis,
    start_router,
    start_sims,
)
from loadgen.workloads import parse_overrides
from loadgen.workloads.base import Call, SessionScript, Spawn, Workload
from loadgen.workloads.hints import HintMode, HintPolicy
from proxy.settings import RetentionSettings

if TYPE_CHECKING:
    from loadgen.bench_cli import Subparsers

HINTED: dict[str, HintMode] = {
    "none": "none",
    "session": "session",
    "full": "full",
    "full+dispatch": "full",
    "full+unbounded": "full",
    "none+priority": "none",
    "full+priority": "full",
    "full+pins": "full",
    "full+tiercover": "full",
    "full+step-deadline": "full",
}
# kvkeeper settings a target adds to the run's own (``--retention``)
TARGET_RETENTION: dict[str, dict[str, Any]] = {
    "full+dispatch": {"dispatch_ahead": 2},
    "full+unbounded": {"max_overhead_share": None},
    "none+priority": {"admission_priority": True},
    "full+priority": {"admission_priority": True},
    "full+pins": {"tier_pin_share": 0.5},
    "full+tiercover": {"tier_skip_touches": True},
    "full+step-deadline": {"touch_deadline_steps": 3},
}
PRIORITY_TARGETS = frozenset({"none+priority", "full+priority"})  # their engines: priority policy
# A/B of one setting: run only when named
BELADY = "engine-belady"  # vanilla engine evicting by the recorded future (loadgen.sim.belady)
DEAD_FIRST = "engine-deadfirst"  # ... dropping only blocks never used again first, else LRU
ORACLE_RULES: dict[str, EvictRule] = {BELADY: "belady", DEAD_FIRST: "dead-first"}
ON_REQUEST = (
    frozenset(
        {
            "full+unbounded",
            "engine-notier",
            BELADY,
            DEAD_FIRST,
            "full+pins",
            "full+tiercover",
            "full+step-deadline",
        }
    )
    | PRIORITY_TARGETS
)
PLAIN = frozenset({"engine", "engine-notier", BELADY, DEAD_FIRST})  # straight to the engine
ROUTER_POLICIES = {"round-robin": "round_robin", "vllm-router": "cache_aware"}
TARGETS = (
    "engine",
    "engine-notier",
    BELADY,
    DEAD_FIRST,
    "none",
    "session",
    "full",
    "full+dispatch",
    "full+unbounded",
    "none+priority",
    "full+priority",
    "full+pins",
    "full+tiercover",
    "full+step-deadline",
    "round-robin",
    "vllm-router",
)
EXTRA_COUNTERS = (
    "kvkeeper_touches_total",
    "kvkeeper_expiries_total",
    "kvkeeper_pressure_overrides_total",
    "kvkeeper_prefetches_total",
    "kvkeeper_offloads_total",
    "kvkeeper_anchor_touches_total",
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
    router: str | None = None
    model: str = "sim"
    repeats: int = 1
    base: str | None = None  # the reference of `vs base` and gap closed (None: DEFAULT_BASES)


@dataclass(slots=True)
class TargetRun:
    name: str
    result: RunResult | None
    summary: dict[str, Any] | None
    counters: dict[str, float]
    wall_s: float
    skipped: str | None = None
    note: str | None = None
    engine: dict[str, float] | None = None  # ENGINE_COUNTERS over the run, summed over engines


# --- targets -------------------------------------------------------------------------------------
def split_target(name: str) -> tuple[str, dict[str, Any]]:
    """``full+pins@tier_pin_share=0.8`` -> ``("full+pins", {"tier_pin_share": 0.8})``."""
    base, *items = name.split("@")
    return base, parse_overrides(items)


def plan_targets(
    requested: Sequence[str], replicas: int, router: str | None, simulated: bool = True
) -> list[tuple[str, str | None]]:
    """``(target, reason skipped or None)`` in run order."""
    names = list(requested) or [
        t
        for t in TARGETS
        if t not in ON_REQUEST and ((t == "engine") == (replicas == 1) or t in HINTED)
    ]
    out: list[tuple[str, str | None]] = []
    for name in names:
        base, settings = split_target(name)
        if base not in TARGETS:
            raise ValueError(f"unknown target {base!r}; choose from {', '.join(TARGETS)}")
        if settings and base not in HINTED:
            raise ValueError(f"{name!r}: only kvkeeper targets take settings after '@'")
        if unknown := sorted(set(settings) - set(RetentionSettings.model_fields)):
            raise ValueError(f"{name!r}: no retention setting {', '.join(unknown)}")
        reason = None
        if base in PLAIN and replicas > 1:
            reason = "several replicas: a plain client cannot spread over them"
        elif base in ORACLE_RULES and not simulated:
            reason = "eviction by the future needs the simulator"
        elif base in ORACLE_RULES and all(skipped for _, skipped in out):
            reason = "eviction by the future needs an earlier target's timeline: name it after one"
        elif base in ROUTER_POLICIES and router is None:
            reason = "vllm-router is not installed"
        out.append((name, reason))
    return out


@contextlib.asynccontextmanager
async def _engines(
    spec: CompareSpec, name: str, oracle: Path | None = None
) -> AsyncIterator[list[SimEndpoints]]:
    """Fresh simulators for target ``name``, or the configured real engines (cache reset)."""
    if spec.engine_urls:
        failed = await reset_prefix_cache(spec.engine_urls)
        if failed:
            print(f"warning: prefix cache not reset on {', '.join(failed)}", flush=True)
        events = list(spec.engine_events) + [""] * len(spec.engine_urls)
        yield [
            SimEndpoints(u, e or "", None, None)
            for u, e in zip(spec.engine_urls, events, strict=False)
        ]
        return
    base, _ = split_target(name)
    sim = replace(spec.sim, scheduling_policy="priority") if base in PRIORITY_TARGETS else spec.sim
    if base == "engine-notier":
        sim = replace(sim, cpu_blocks=0)
    if base in ORACLE_RULES:
        assert oracle is not None
        sim = replace(
            sim,
            cpu_blocks=0,
            cpu_l2_blocks=0,
            evict_oracle=str(oracle),
            evict_rule=ORACLE_RULES[base],
        )
    async with start_sims(sim, spec.replicas) as sims:
        yield sims


@contextlib.asynccontextmanager
async def _front(name: str, sims: list[SimEndpoints], spec: CompareSpec) -> AsyncIterator[str]:
    """The URL the client talks to for target ``name``, with whatever runs in front."""
    logs = spec.out / "logs"
    base, settings = split_target(name)
    if base in PLAIN:
        yield sims[0].url
    elif base in ROUTER_POLICIES:
        assert spec.router is not None
        async with start_router(
            spec.router, [s.url for s in sims], ROUTER_POLICIES[base], logs
        ) as url:
            yield url
    else:
        retention = {
            "block_size": spec.sim.block_size,
            **TARGET_RETENTION.get(base, {}),
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


def engine_work(counters: Mapping[str, float] | None) -> dict[str, float] | None:
    """What the engines did in a run: prompt tokens computed (looked up and found neither in
    the GPU cache nor in the tier: the clients' misses, touches' and warm-ups', and what
    preemptions made them compute again), loaded from the tier, and preemptions; None when the
    engines export no prefix-cache counters. Simulators add ``sim_lag``: the wall time their
    step loops ran behind the modelled clock, as a share of the modelled time (0.1: the engine
    ran 10% slower than its profile says, from the simulator's own processing time)."""
    if not counters or "vllm:prefix_cache_queries_total" not in counters:
        return None
    queries = counters["vllm:prefix_cache_queries_total"]
    gpu = counters.get("vllm:prefix_cache_hits_total", 0.0)
    tier = counters.get("vllm:external_prefix_cache_hits_total", 0.0)
    work = {
        "computed_tokens": max(0.0, queries - gpu - tier),
        "tier_loaded_tokens": tier,
        "preemptions": counters.get("vllm:num_preemptions_total", 0.0),
    }
    if (modelled := counters.get("kvkeeper_sim_modelled_seconds_total", 0.0)) > 0:
        work["sim_lag"] = counters.get("kvkeeper_sim_lag_seconds_total", 0.0) / modelled
    return work


def _write_text(path: Path, text: str) -> None:  # sync, off the coroutine (ruff ASYNC240)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


async def run_target(
    name: str, workload: Workload, spec: CompareSpec, tag: str, timeline: TargetRun | None = None
) -> TargetRun:
    """Bring up a fresh stack for ``name``, play the workload, tear it down; ``timeline``:
    the run whose sends the oracle of ``engine-belady`` (or ``engine-deadfirst``) is taken from."""
    t0 = time.monotonic()
    base, _ = split_target(name)
    mode = HINTED.get(base, "none")
    oracle: Path | None = None
    note: str | None = None
    if base in ORACLE_RULES:
        assert timeline is not None and timeline.result is not None
        oracle = spec.out / "logs" / f"{name}-oracle.json"
        blocks = await asyncio.to_thread(
            write_oracle, oracle, workload, timeline.result, spec.sim.hash_seed
        )
        rule = "" if base == BELADY else ", dead blocks first, then LRU"
        note = f"evicts by the future uses of {timeline.name}'s sends ({blocks:,} blocks{rule})"
    async with _engines(spec, name, oracle) as sims, _front(name, sims, spec) as url:
        target = Target(url, spec.model, replace(spec.hints, mode=mode), api=spec.api)  # type: ignore[arg-type]
        options = replace(spec.options, run_tag=tag)
        before = await _engine_counters(sims)  # real engines count from their start
        result = await run_workload(workload, target, options, label=name)
        engine = engine_work(counter_delta(before, await _engine_counters(sims)))
        keep = spec.out / "logs" / f"{name}-metrics.txt"
        counters = {}
        if base in HINTED:
            counters = await _scrape(url, keep)
        elif base in ORACLE_RULES:  # the simulator's check that its oracle knew every block
            counters = await _scrape(url, keep, BELADY_COUNTERS)
    result.save(spec.out / f"{name}.json")
    return TargetRun(
        name, result, summarize(result), counters, time.monotonic() - t0, note=note, engine=engine
    )


def write_oracle(path: Path, workload: Workload, result: RunResult, hash_seed: str) -> int:
    """Write the Belady oracle of ``result``'s sends (block hashes exactly as the engine
    computes them from the token ids the runner sends); returns how many blocks it lists."""
    bt = workload.block_tokens
    chains = ceiling.BlockChains(bt)
    hasher = BlockHashCache(bt, hash_seed)
    known: dict[int, bytes] = {}  # the ceiling's block key -> the engine's block hash

    def uses() -> Iterator[tuple[float, list[bytes]]]:
        for rec, call in sent_calls(workload, result):
            pieces = list(call.pieces())
            keys = chains.keys(pieces)
            seq = SimSequence("oracle", tokens.render_ids(pieces))
            for key in keys:
                if key not in known:
                    break
                seq.block_hashes.append(known[key])
            hasher.update(seq)  # hashes only the blocks after the known prefix
            known.update(zip(keys, seq.block_hashes, strict=False))
            yield rec.t_start, seq.block_hashes

    doc = oracle_document(uses(), bt, hash_seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return len(doc["blocks"])


# --- ceilings ------------------------------------------------------------------------------------
def arrival_of(workload: Workload, options: RunOptions) -> tuple[ceiling.Arrival, int]:
    """The ceiling's arrival model matching how the runner starts root sessions."""
    if options.max_sessions > 0:
        return "slots", options.max_sessions
    return "open", 0


def largest_request_blocks(workload: Workload) -> int:
    """Blocks the largest call needs (prompt + output): an engine refuses a smaller pool."""
    bt = workload.block_tokens
    return max((-(-(c.prompt_tokens + c.max_tokens) // bt) for c in workload.calls()), default=1)


def planned_ceilings(
    workload: Workload,
    options: RunOptions,
    frac: float | None,
    capacity: int | None,
    floor: int = 1,
) -> dict[str, Any]:
    """Peak working set and inf/Belady/LRU at the pool's capacity on the tool's own timeline;
    a share of the working set below ``floor`` blocks is raised to it (``raised_to_fit``)."""
    arrival, n = arrival_of(workload, options)
    replay = ceiling.layout(workload, arrival, n)
    peak = ceiling.peak_working_set(replay)
    cap = capacity if capacity is not None else max(floor, round((frac or 1.0) * peak))
    raised = capacity is None and cap > round((frac or 1.0) * peak)
    rates = replay_rates(replay, cap)
    return {"arrival": arrival, "n": n, "peak_ws": peak, "raised_to_fit": raised, **rates}


def replay_rates(replay: ceiling.Replay, capacity: int) -> dict[str, Any]:
    total = max(1, replay.total_tokens)
    bt = replay.block_tokens
    rates: dict[str, Any] = {"C": capacity, "inf": bt * ceiling.infinite_hits(replay) / total}
    for policy in ceiling.POLICIES:
        res = ceiling.simulate(replay, capacity, policy)
        rates[policy] = bt * res.hit_blocks / total
        rates["no_room"] = bt * res.no_room_blocks / total
    return rates


def _scripts(sessions: Sequence[SessionScript]) -> Iterator[SessionScript]:
    for s in sessions:
        yield s
        for step in s.steps:
            if isinstance(step, Spawn):
                yield from _scripts(step.children)


def sent_calls(workload: Workload, result: RunResult) -> Iterator[tuple[RequestRecord, Call]]:
    """Each request of the run with the workload call it sent."""
    by_id = {s.session_id: s for s in _scripts(workload.sessions)}
    for rec in result.requests:
        script = by_id[rec.session_id.split("-", 1)[1]]
        call = script.steps[rec.turn]
        assert isinstance(call, Call)
        yield rec, call


def realized_replay(
    workload: Workload, result: RunResult, *, from_first_token: bool = False
) -> ceiling.Replay:
    """The calls as the run really timed them (start, end), as a ceiling replay.

    ``from_first_token``: each call looks its prefix up and holds its blocks from its first
    token instead of from when it was sent. The engine does that at admission, which is
    earlier (the prefill runs in between), so this timeline shows what eviction order could
    win once the wait in the engine's queue is taken as given: a waiting request holds no
    blocks, and the ``realized`` ceilings, which pin them from the send time, count as won
    what the wait loses."""
    chains = ceiling.BlockChains(workload.block_tokens)
    reqs = []
    for rec, call in sent_calls(workload, result):
        start = rec.t_start + (rec.ttft or 0.0) if from_first_token else rec.t_start
        reqs.append(
            ceiling.Req(
                min(start, rec.t_end), rec.t_end, chains.keys(call.pieces()), call.prompt_tokens
            )
        )
    return ceiling.Replay(reqs, workload.block_tokens)


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
    doc = compare_document(workload, spec, planned, runs)
    (spec.out / "compare.json").write_text(json.dumps(doc, indent=1))
    (spec.out / "compare.md").write_text(render_markdown(doc))
    _render_report(runs, spec.out)
    return doc


# figures aggregated over rounds, as paths into a target's entry
AGGREGATED: tuple[tuple[str, ...], ...] = (
    ("hit_rate",),
    ("hit_rate_vs_base_pp",),
    ("gap_closed",),
    ("gap_closed_first_token",),
    ("ttft", "mean"),
    ("ttft", "p90"),
    ("ttft_mean_vs_base",),
    ("ttft_p90_vs_base",),
    ("ttft_mean_vs_belady",),
    ("recomputed_prompt_tokens",),
    ("retention_prompt_share",),
    ("retention_recomputed_share",),
    ("errors",),
)


def _dig(entry: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = entry
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, int | float) else None


def aggregate_rounds(rounds: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Mean, min and max over rounds of every figure in :data:`AGGREGATED`, per target.

    A figure a round does not have (a skipped target, no baseline) is left out of that
    figure's statistics; ``n`` says how many rounds each one has."""
    first = rounds[0]
    targets: dict[str, Any] = {}
    for name in first["targets"]:
        entries = [r["targets"].get(name, {}) for r in rounds]
        if all("skipped" in e for e in entries):
            targets[name] = {"skipped": entries[0]["skipped"]}
            continue
        figures: dict[str, Any] = {}
        for path in AGGREGATED:
            values = [v for e in entries if (v := _dig(e, path)) is not None]
            if values:
                figures[".".join(path)] = {
                    "mean": sum(values) / len(values),
                    "min": min(values),
                    "max": max(values),
                    "n": len(values),
                    "values": values,
                }
        targets[name] = figures
    realized = [r["ceilings"]["realized"] for r in rounds if r["ceilings"]["realized"]]
    admitted = [r["ceilings"]["admitted"] for r in rounds if r["ceilings"].get("admitted")]
    return {
        "workload": first["workload"],
        "params": first["params"],
        "setup": first["setup"],
        "base": first.get("base"),
        "repeats": len(rounds),
        "rounds": list(names),
        "ceilings": {
            "planned": first["ceilings"]["planned"],
            "realized": realized,
            "admitted": admitted,
        },
        "targets": targets,
    }


def compare_document(
    workload: Workload, spec: CompareSpec, planned: dict[str, Any], runs: list[TargetRun]
) -> dict[str, Any]:
    done = [r for r in runs if r.result is not None]
    realized = admitted = None
    if done:
        first = done[0]
        assert first.result is not None
        replay = realized_replay(workload, first.result)
        realized = {"from": first.name, **replay_rates(replay, planned["C"])}
        replay = realized_replay(workload, first.result, from_first_token=True)
        admitted = {"from": first.name, **replay_rates(replay, planned["C"])}
    doc: dict[str, Any] = {
        "workload": workload.name,
        "params": dict(workload.params),
        "setup": _setup(spec),
        "ceilings": {"planned": planned, "realized": realized, "admitted": admitted},
        "targets": {},
    }
    base_name, base = _baseline(runs, spec.base)
    doc["base"] = base_name
    lru_ref = base["hit_rate"] if base else planned["lru"]
    belady = (realized or planned)["belady"]
    reachable = admitted["belady"] if admitted else None
    oracle = next((r.summary for r in runs if r.name == BELADY and r.summary), None)
    for r in runs:
        doc["targets"][r.name] = _target_entry(r, base, lru_ref, belady, oracle, reachable)
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


# the vanilla reference when none is named: straight to the engine, else round robin, else none
DEFAULT_BASES = ("engine", "round-robin", "none")


def _baseline(
    runs: list[TargetRun], named: str | None = None
) -> tuple[str | None, dict[str, Any] | None]:
    """The reference target's name and summary: ``named`` (``--base``), else the first of
    :data:`DEFAULT_BASES` that ran (with a tier, ``engine`` is plain LMCache and
    ``--base engine-notier`` measures against vanilla vLLM without it)."""
    for name in (named,) if named else DEFAULT_BASES:
        for r in runs:
            if r.name == name and r.summary is not None:
                return name, r.summary
    return None, None


def _target_entry(
    r: TargetRun,
    base: dict[str, Any] | None,
    lru_ref: float,
    belady: float,
    oracle: dict[str, Any] | None = None,
    belady_first_token: float | None = None,
) -> dict[str, Any]:
    """One target's figures; ``oracle``: the ``engine-belady`` run's summary, if any.

    ``gap_closed`` is measured to ``belady`` (the realized timeline, blocks held from the send),
    ``gap_closed_first_token`` to ``belady_first_token`` (held from the first token, as the
    engine holds them: a request in its queue holds none), the one an engine evicting by
    Belady's rule reaches."""
    if r.summary is None:
        return {"skipped": r.skipped}
    s = r.summary
    entry = {k: v for k, v in s.items() if k != "by_agent"}
    entry["wall_s"] = r.wall_s
    if r.note:
        entry["note"] = r.note
    if oracle is not None and oracle["ttft"]["mean"] and s["ttft"]["mean"] is not None:
        entry["ttft_mean_vs_belady"] = s["ttft"]["mean"] / oracle["ttft"]["mean"] - 1
    entry["counters"] = r.counters
    if r.engine is not None:
        entry["engine"] = r.engine
    hit = s["hit_rate"] or 0.0
    entry["gap_closed"] = gap_closed(hit, lru_ref, belady)
    if belady_first_token is not None:
        entry["gap_closed_first_token"] = gap_closed(hit, lru_ref, belady_first_token)
    sent = s.get("retention_prompt_tokens")
    spent = s.get("retention_recomputed_tokens")
    prompt = s["prompt_tokens"] or 1
    entry["retention_prompt_share"] = None if sent is None else sent / (prompt + sent)
    # what retention cost, per prompt token the workload itself sent (the issue's 2% goal)
    entry["retention_recomputed_share"] = None if spent is None else spent / prompt
    if base is not None and base["ttft"]["mean"] and s["ttft"]["mean"] is not None:
        entry["ttft_mean_vs_base"] = s["ttft"]["mean"] / base["ttft"]["mean"] - 1
        entry["ttft_p90_vs_base"] = s["ttft"]["p90"] / base["ttft"]["p90"] - 1
        entry["hit_rate_vs_base_pp"] = 100 * (hit - (base["hit_rate"] or 0.0))
    return entry


def gap_closed(hit: float, lru: float, belady: float) -> float | None:
    """The share of the LRU-to-Belady gap ``hit`` closes; None where there is no gap."""
    gap = belady - lru
    return (hit - lru) / gap if gap > 1e-9 else None


# --- rendering -----------------------------------------------------------------------------------
def _pct(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:+.1f}%" if signed else f"{100 * v:.1f}%"


def _sec(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def render_markdown(doc: dict[str, Any]) -> str:
    c = doc["ceilings"]
    planned, realized, admitted = c["planned"], c["realized"], c.get("admitted")
    oracle = any("ttft_mean_vs_belady" in t for t in doc["targets"].values())
    lines = [
        f"### {doc['workload']}: {len(doc['targets'])} targets, pool {planned['C']} blocks "
        f"(peak working set {planned['peak_ws']}"
        + ("; raised to fit the largest request)" if planned.get("raised_to_fit") else ")"),
        "",
        f"Base: `{doc.get('base') or '-'}` (`vs base` and gap closed, to the realized Belady).",
        "",
        "| target | hit rate | gap closed | gap closed (first token) | TTFT mean s | TTFT p90 s "
        "| TTFT mean vs base | "
        + ("TTFT mean vs engine-belady | " if oracle else "")
        + "recomputed prompt tok | retention prompt tok (share) | retention recomputed (share) "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if oracle else ""),
    ]
    for name, t in doc["targets"].items():
        if "skipped" in t:
            lines.append(f"| {name} | skipped: {t['skipped']} |" + " |" * (10 if oracle else 9))
            continue
        ret = (
            "-"
            if t["retention_prompt_tokens"] is None
            else (f"{t['retention_prompt_tokens']:,.0f} ({_pct(t['retention_prompt_share'])})")
        )
        rec = (
            "-"
            if t["retention_recomputed_tokens"] is None
            else (
                f"{t['retention_recomputed_tokens']:,.0f} ({_pct(t['retention_recomputed_share'])})"
            )
        )
        lines.append(
            f"| {name} | {_pct(t['hit_rate'])} | {_pct(t['gap_closed'])} | "
            f"{_pct(t.get('gap_closed_first_token'))} | "
            f"{_sec(t['ttft']['mean'])} | {_sec(t['ttft']['p90'])} | "
            f"{_pct(t.get('ttft_mean_vs_base'), signed=True)} | "
            + (f"{_pct(t.get('ttft_mean_vs_belady'), signed=True)} | " if oracle else "")
            + f"{t['recomputed_prompt_tokens']:,} | {ret} | {rec} | {t['errors']} |"
        )
    lines += [
        "",
        "| ceiling (same capacity) | LRU | Belady | infinite | no room |",
        "|---|---|---|---|---|",
    ]
    for label, row in (
        ("planned timeline", planned),
        (f"realized ({realized['from']})" if realized else "", realized),
        (
            f"realized, held from the first token ({admitted['from']})" if admitted else "",
            admitted,
        ),
    ):
        if row:
            lines.append(
                f"| {label} | {_pct(row['lru'])} | {_pct(row['belady'])} | {_pct(row['inf'])} | {_pct(row['no_room'])} |"
            )
    lines += [
        "",
        "Gap closed: (hit - base hit) / (realized Belady - base hit); (first token): to the "
        "Belady held from the first token. Held from the first token: each call "
        "holds its blocks from its first token, not from when it was sent (a request waiting "
        "in the engine's queue holds none). Retention prompt share: of all prompt "
        "tokens sent (workload + touches + warm-ups); retention recomputed share: of the "
        "workload's own prompt tokens.",
        "",
    ]
    lines += [f"- {n}: {t['note']}" for n, t in doc["targets"].items() if t.get("note")]
    for name, t in doc["targets"].items():
        if (work := t.get("engine")) is not None:
            lines.append(
                f"- {name}: the engines computed {work['computed_tokens']:,.0f} prompt tokens, "
                f"loaded {work['tier_loaded_tokens']:,.0f} from the tier, "
                f"{work['preemptions']:,.0f} preemptions"
                + (
                    f"; the simulator ran {work['sim_lag']:.1%} behind its modelled clock"
                    if "sim_lag" in work
                    else ""
                )
            )
    counters = {n: t.get("counters") for n, t in doc["targets"].items() if t.get("counters")}
    for name, cnt in counters.items():
        text = ", ".join(
            f"{k.removeprefix('kvkeeper_').removesuffix('_total')} {v:,.0f}" for k, v in cnt.items()
        )
        lines.append(f"- {name}: {text}")
    return "\n".join(lines) + "\n"


def render_aggregate(doc: dict[str, Any]) -> str:
    """The table of a ``--repeats`` comparison: mean (min to max) over rounds."""

    def cell(fig: dict[str, Any] | None, fmt: str) -> str:
        if fig is None:
            return "-"
        if fmt == "pp":
            f = "{:+.1f}"
        elif fmt == "pct":
            fig = {k: 100 * fig[k] for k in ("mean", "min", "max")}
            f = "{:.1f}%"
        elif fmt == "spct":
            fig = {k: 100 * fig[k] for k in ("mean", "min", "max")}
            f = "{:+.1f}%"
        else:
            f = "{:.3f}"
        return f"{f.format(fig['mean'])} ({f.format(fig['min'])} to {f.format(fig['max'])})"

    planned = doc["ceilings"]["planned"]
    oracle = any("ttft_mean_vs_belady" in t for t in doc["targets"].values())
    lines = [
        f"### {doc['workload']}: {len(doc['targets'])} targets, {doc['repeats']} rounds, "
        f"pool {planned['C']} blocks (peak working set {planned['peak_ws']})",
        "",
        "Mean over rounds (min to max). `vs base`: the same round's "
        + (f"`{doc['base']}`" if doc.get("base") else "baseline")
        + "; gap closed per round from it to that round's realized Belady (first token: to the "
        "one held from the first token).",
        "",
        "| target | hit rate | hit vs base pp | gap closed | gap closed (first token) "
        "| TTFT mean s | TTFT mean vs base | TTFT p90 vs base | "
        + ("TTFT mean vs engine-belady | " if oracle else "")
        + "retention recomputed share | errors |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if oracle else ""),
    ]
    for name, t in doc["targets"].items():
        if "skipped" in t:
            lines.append(f"| {name} | skipped: {t['skipped']} |" + " |" * (9 if oracle else 8))
            continue
        errors = t.get("errors", {}).get("max", 0)
        lines.append(
            f"| {name} | {cell(t.get('hit_rate'), 'pct')} | "
            f"{cell(t.get('hit_rate_vs_base_pp'), 'pp')} | {cell(t.get('gap_closed'), 'pct')} | "
            f"{cell(t.get('gap_closed_first_token'), 'pct')} | "
            f"{cell(t.get('ttft.mean'), 's')} | {cell(t.get('ttft_mean_vs_base'), 'spct')} | "
            f"{cell(t.get('ttft_p90_vs_base'), 'spct')} | "
            + (f"{cell(t.get('ttft_mean_vs_belady'), 'spct')} | " if oracle else "")
            + f"{cell(t.get('retention_recomputed_share'), 'pct')} | {errors:.0f} |"
        )
    lines += ["", "| realized ceilings | LRU | Belady | infinite |", "|---|---|---|---|"]
    for name, row in zip(doc["rounds"], doc["ceilings"]["realized"], strict=False):
        lines.append(
            f"| {name} ({row['from']}) | {_pct(row['lru'])} | {_pct(row['belady'])} "
            f"| {_pct(row['inf'])} |"
        )
    for name, row in zip(doc["rounds"], doc["ceilings"].get("admitted", []), strict=False):
        lines.append(
            f"| {name} ({row['from']}), held from the first token | {_pct(row['lru'])} "
            f"| {_pct(row['belady'])} | {_pct(row['inf'])} |"
        )
    lines.append(
        f"| planned timeline | {_pct(planned['lru'])} | {_pct(planned['belady'])} "
        f"| {_pct(planned['inf'])} |"
    )
    return "\n".join(lines) + "\n"


def _render_report(runs: list[TargetRun], out: Path) -> None:
    from loadgen.report import render_report

    results = [r.result for r in runs if r.result is not None]
    if results:
        render_report(results, out)


# --- CLI -----------------------------------------------------------------------------------------
def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "compare", help="one workload against engine / kvkeeper hint modes / routers"
    )
    _add_workload_args(p, None)
    p.add_argument(
        "--targets",
        default="",
        help=(
            f"comma list from {','.join(TARGETS)} (default: all that apply); a kvkeeper "
            "target takes retention settings after '@', e.g. full+pins@tier_pin_share=0.8"
        ),
    )
    p.add_argument("--replicas", type=int, default=1, help="engine replicas (simulator)")
    p.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="real engine instead of the simulator (repeatable)",
    )
    p.add_argument(
        "--engine-events",
        action="append",
        default=[],
        help="KV-event endpoint of the i-th --engine-url",
    )
    p.add_argument("--capacity-blocks", type=int, help="ceiling capacity for --engine-url")
    p.add_argument(
        "--profile", default="h100-llama8b", choices=sorted(PROFILES), help="simulator timing"
    )
    p.add_argument("--speed", type=float, default=1.0, help="simulator time speed-up")
    p.add_argument("--sim-max-lag", type=float, default=SimConfig().max_lag_s, metavar="SECONDS",
                   help="how far the simulators' step loops may run behind their modelled "
                        "clocks and catch up (`kvkeeper sim --max-lag-s`)")  # fmt: skip
    p.add_argument(
        "--num-blocks", type=int, default=2048, help="simulator pool (without --pool-frac)"
    )
    p.add_argument("--pool-frac", type=float, help="pool as a share of the peak working set")
    p.add_argument("--cpu-blocks", type=int, default=0, help="simulator CPU tier (0: none)")
    p.add_argument(
        "--cpu-l2-blocks",
        type=int,
        default=0,
        help="the simulator CPU tier's L2, LMCache MP-shaped: L1 LRU, pins protect L2 (0: none)",
    )
    p.add_argument("--no-offload", action="store_true", help="do not give kvkeeper the CPU tier")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="the simulators' waiting-queue order (every target's engine)",
    )
    p.add_argument("--max-model-len", type=int, default=262_144)
    p.add_argument("--model", default="sim")
    p.add_argument(
        "--api",
        default="completions-ids",
        choices=("chat", "completions", "completions-ids", "workload"),
    )
    p.add_argument("--concurrency", type=int, default=64, help="model requests in flight")
    p.add_argument("--max-sessions", type=int, default=0, help="open root sessions (0: all)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies all pauses")
    p.add_argument("--ttl-factor", type=float, default=2.0)
    p.add_argument("--ttl-cap", type=float, default=600.0)
    p.add_argument("--prefetch-lead", type=float, default=1.0)
    p.add_argument(
        "--retention",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="kvkeeper retention setting (repeatable)",
    )
    p.add_argument("--router", help="vllm-router executable (default: found on PATH)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="play the comparison this many times and report mean and range (default 1)",
    )
    p.add_argument(
        "--base",
        metavar="TARGET",
        help="the reference of `vs base` and gap closed, one of the targets "
        "(default: engine, else round-robin, else none; with --cpu-blocks, engine-notier "
        "measures against vanilla vLLM without the tier)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_compare)


def spec_from_args(args: argparse.Namespace) -> CompareSpec:
    sim = SimConfig(
        model=args.model,
        profile=args.profile,
        speed=args.speed,
        max_lag_s=args.sim_max_lag,
        num_blocks=args.num_blocks,
        cpu_blocks=args.cpu_blocks,
        cpu_l2_blocks=args.cpu_l2_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
    )
    return CompareSpec(
        out=Path(args.out),
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        replicas=args.replicas if not args.engine_url else len(args.engine_url),
        sim=sim,
        pool_frac=args.pool_frac,
        engine_urls=tuple(args.engine_url),
        engine_events=tuple(args.engine_events),
        capacity_blocks=args.capacity_blocks,
        options=RunOptions(
            concurrency=args.concurrency,
            max_sessions=args.max_sessions,
            time_scale=args.time_scale,
            progress=not args.no_progress,
        ),
        hints=HintPolicy(
            ttl_factor=args.ttl_factor, ttl_cap=args.ttl_cap, prefetch_lead=args.prefetch_lead
        ),
        api=None if args.api == "workload" else args.api,
        retention=parse_overrides(args.retention),
        offload=not args.no_offload,
        router=find_router(args.router),
        model=args.model,
        repeats=max(1, args.repeats),
        base=args.base,
    )


def _cmd_compare(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    spec = spec_from_args(args)
    try:
        doc = asyncio.run(run_compare(workload, spec))
    except ValueError as e:  # a bad target list or --base: refused before anything ran
        print(f"kvkeeper bench compare: error: {e}", file=sys.stderr)
        return 2
    if spec.repeats > 1:
        print(render_aggregate(doc))
        errors = sum(t.get("errors", {}).get("max", 0) for t in doc["targets"].values())
    else:
        print(render_markdown(doc))
        errors = sum(t.get("errors", 0) for t in doc["targets"].values())
    print(f"results: {spec.out}")
    return 0 if errors == 0 else 1
