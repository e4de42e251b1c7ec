"""The document of a comparison: each target's figures against the baseline and the ceilings,
and the mean and range over rounds of a ``--repeats`` comparison."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadgen.compare_ceilings import gap_closed, realized_replay, replay_rates
from loadgen.records import RunResult
from loadgen.workloads.base import Workload

BELADY = "engine-belady"  # every target's mean TTFT is also given against this one's


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
    ("ttft_engine_time", "mean"),
    ("ttft_engine_time", "p90"),
    ("ttft_engine_time_mean_vs_base",),
    ("ttft_engine_time_p90_vs_base",),
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
    workload: Workload,
    setup: dict[str, Any],
    planned: dict[str, Any],
    runs: list[TargetRun],
    base: str | None = None,
) -> dict[str, Any]:
    """Every target's figures; ``base``: the reference target (None: :data:`DEFAULT_BASES`)."""
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
        "setup": setup,
        "ceilings": {"planned": planned, "realized": realized, "admitted": admitted},
        "targets": {},
    }
    base_name, ref = _baseline(runs, base)
    doc["base"] = base_name
    lru_ref = ref["hit_rate"] if ref else planned["lru"]
    belady = (realized or planned)["belady"]
    reachable = admitted["belady"] if admitted else None
    oracle = next((r.summary for r in runs if r.name == BELADY and r.summary), None)
    for r in runs:
        doc["targets"][r.name] = _target_entry(r, ref, lru_ref, belady, oracle, reachable)
    return doc


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
    # what retention cost, per prompt token the workload itself sent (the goal: under 2%)
    entry["retention_recomputed_share"] = None if spent is None else spent / prompt
    if base is not None and base["ttft"]["mean"] and s["ttft"]["mean"] is not None:
        entry["ttft_mean_vs_base"] = s["ttft"]["mean"] / base["ttft"]["mean"] - 1
        entry["ttft_p90_vs_base"] = s["ttft"]["p90"] / base["ttft"]["p90"] - 1
        entry["hit_rate_vs_base_pp"] = 100 * (hit - (base["hit_rate"] or 0.0))
    # the same against the engine-time TTFT (loadgen.metrics.engine_time_ttft)
    mine, theirs = s.get("ttft_engine_time") or {}, (base or {}).get("ttft_engine_time") or {}
    if theirs.get("mean") and mine.get("mean") is not None:
        entry["ttft_engine_time_mean_vs_base"] = mine["mean"] / theirs["mean"] - 1
        if theirs.get("p90") and mine.get("p90") is not None:
            entry["ttft_engine_time_p90_vs_base"] = mine["p90"] / theirs["p90"] - 1
    return entry
