"""``kvkeeper bench compare`` end to end: real simulator subprocesses, real kvkeeper + Redis
subprocesses, real vllm-router when installed; figures checked against the offline ceilings."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from loadgen import ceiling
from loadgen.bench_compare import CompareSpec, run_compare
from loadgen.bench_targets import plan_targets
from loadgen.compare_ceilings import largest_request_blocks, realized_replay, replay_rates
from loadgen.compare_doc import aggregate_rounds
from loadgen.records import RunResult
from loadgen.runner import RunOptions
from loadgen.sim.server import SimConfig
from loadgen.stack import find_router
from loadgen.workloads import build_workload
from loadgen.workloads.base import Workload
from proxy.cli import build_parser, main

ROUTER = find_router()


def small_swarm() -> Workload:
    """Three users over four agents: anchors shared across users, a few tool pauses each."""
    return build_workload(
        "swarm",
        {"users": 3, "agents": 3, "token_scale": 0.1, "arrival_rate": 2.0, "pause_cap": 2.0,
         "max_dispatches": 4},
    )  # fmt: skip


def spec(tmp_path: Path, targets: tuple[str, ...], frac: float, **kw: object) -> CompareSpec:
    sim = SimConfig(profile="cpu-smollm2", speed=40.0, reply_tokens=1)
    base = CompareSpec(
        out=tmp_path / "cmp",
        targets=targets,
        sim=sim,
        pool_frac=frac,
        options=RunOptions(concurrency=16, time_scale=0.2, progress=False),
        retention={"tick_s": 0.05},
    )
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("requested", "replicas", "router", "expected"),
    [
        ((), 1, None, [("engine", None), ("none", None), ("session", None), ("full", None)]),
        ((), 2, "/x", [("none", None), ("session", None), ("full", None),
                       ("round-robin", None), ("vllm-router", None)]),
        (("full", "full+unbounded"), 1, None, [("full", None), ("full+unbounded", None)]),
        (("none+priority", "full+priority"), 2, None,
         [("none+priority", None), ("full+priority", None)]),
        (("full+pins@tier_pin_share=0.8", "full@return_ttl_factor=3@budget_share=0.3"), 1, None,
         [("full+pins@tier_pin_share=0.8", None), ("full@return_ttl_factor=3@budget_share=0.3", None)]),
        (("engine", "engine-belady"), 1, None, [("engine", None), ("engine-belady", None)]),
        (("engine-belady", "engine"), 1, None,
         [("engine-belady", "eviction by the future needs an earlier target's timeline: name it after "
                            "one"), ("engine", None)]),
        (("engine", "vllm-router"), 2, None,
         [("engine", "several replicas: a plain client cannot spread over them"),
          ("vllm-router", "vllm-router is not installed")]),
    ],
)  # fmt: skip
def test_plan_targets(
    requested: tuple[str, ...],
    replicas: int,
    router: str | None,
    expected: list[tuple[str, str | None]],
) -> None:
    assert plan_targets(requested, replicas, router) == expected


def test_plan_skips_belady_on_real_engines() -> None:
    plan = plan_targets(("engine", "engine-belady"), 1, None, simulated=False)
    assert plan[1] == ("engine-belady", "eviction by the future needs the simulator")


def test_plan_rejects_unknown_target() -> None:
    with pytest.raises(ValueError, match="unknown target 'lru'"):
        plan_targets(("lru",), 1, None)


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("engine@tick_s=1", "only kvkeeper targets take settings"),
        ("full@no_such_knob=1", "no retention setting no_such_knob"),
        ("full@tick_s", "expected key=value"),
        ("lru@tick_s=1", "unknown target 'lru'"),
    ],
)
def test_plan_rejects_a_bad_target_setting(name: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        plan_targets((name,), 1, None)


async def test_a_target_setting_reaches_kvkeeper(tmp_path: Path) -> None:
    """``full@return_ttl_factor=2.5`` plays ``full`` with that setting in kvkeeper's config."""
    workload = small_swarm()
    name = "full@return_ttl_factor=2.5"
    doc = await run_compare(workload, spec(tmp_path, (name,), 0.5))
    assert doc["targets"][name]["requests"] == workload.n_calls()
    assert doc["targets"][name]["manage"]  # full hints: the client sent management requests
    (config,) = (tmp_path / "cmp" / "logs").glob("kvkeeper-*.yaml")
    retention = yaml.safe_load(config.read_text())["retention"]
    assert retention["return_ttl_factor"] == 2.5


def test_cli_registers_compare() -> None:
    args = build_parser().parse_args(
        ["bench", "compare", "--workload", "swarm", "--pool-frac", "0.5", "--out", "x"]
    )
    assert args.bench_command == "compare"
    assert args.pool_frac == 0.5
    assert args.base is None


def test_cli_refuses_a_base_that_does_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "compare", "--workload", "swarm", "--set", "users=2", "--targets", "engine",
            "--base", "full", "--pool-frac", "0.5", "--out", str(tmp_path / "x")]  # fmt: skip
    assert main(argv) == 2
    assert "--base 'full' is not one of the targets that run" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


async def test_compare_engine_and_kvkeeper_on_the_simulator(tmp_path: Path) -> None:
    workload = small_swarm()
    doc = await run_compare(workload, spec(tmp_path, ("engine", "none", "full"), 0.5))
    out = tmp_path / "cmp"
    for name in ("compare.json", "compare.md", "report.md", "ttft_cdf.png", "hit_rate.png"):
        assert (out / name).stat().st_size > 0, name
    targets = doc["targets"]
    n_calls = workload.n_calls()
    prompt = sum(c.prompt_tokens for c in workload.calls())
    planned = doc["ceilings"]["planned"]
    # the pool is half the peak working set, unless the largest request needs more; the
    # simulator got exactly that many usable blocks
    need = largest_request_blocks(workload)
    assert planned["C"] == max(round(0.5 * planned["peak_ws"]), need)
    assert planned["raised_to_fit"] == (need > round(0.5 * planned["peak_ws"]))
    assert doc["setup"]["sim"]["num_blocks"] == planned["C"] + 1
    for name in ("engine", "none", "full"):
        t = targets[name]
        if t["errors"]:  # say what went wrong, for a failure seen only on a loaded machine
            recorded = json.loads((out / f"{name}.json").read_text())["requests"]
            errors = [r["error"] for r in recorded if r.get("error")]
            raise AssertionError(f"{name}: {len(errors)} failed requests: {errors[:3]}")
        assert t["requests"] == n_calls
        assert t["prompt_tokens"] == prompt  # token ids: the engine saw the workload's tokens
        # every answer names the simulator process that served it (one replica: one name)
        recorded = json.loads((out / f"{name}.json").read_text())["requests"]
        assert len({r["response_id"].split("-")[1][:8] for r in recorded}) == 1
        assert 0.0 < t["hit_rate"] <= planned["inf"] + 1e-9
    # what the engine did: straight to it, it computed every prompt token its answers did not
    # report cached (no tier, no touches; a preemption would make it compute some again)
    work = targets["engine"]["engine"]
    cached_ = targets["engine"]["cached_tokens"]
    assert work["tier_loaded_tokens"] == 0
    assert work["computed_tokens"] >= prompt - cached_
    if work["preemptions"] == 0:
        assert work["computed_tokens"] == prompt - cached_
    assert "the engines computed" in (out / "compare.md").read_text()
    # the simulator reports how far its own work put it behind its modelled clock
    assert 0.0 <= work["sim_lag"] < 1.0
    assert "behind its modelled clock" in (out / "compare.md").read_text()
    # a plain client through kvkeeper sends the same requests as one straight to the engine
    assert targets["none"]["retention_prompt_tokens"] == 0
    assert targets["engine"]["retention_prompt_tokens"] is None
    # full hints: every session ends with an evict kvkeeper answers itself
    evicts = sum(v for k, v in targets["full"]["manage"].items() if k.startswith("evict:"))
    assert evicts == len(workload.sessions)
    # None when the run's own timeline leaves no LRU-to-Belady gap to close (timing-dependent)
    gap = targets["full"]["gap_closed"]
    assert gap is None or isinstance(gap, float)
    # the realized-timeline LRU replays what the engine did: its hit rate is close to measured
    realized = doc["ceilings"]["realized"]
    assert realized["from"] == "engine"
    assert realized["lru"] <= realized["belady"] + 1e-9 <= realized["inf"] + 2e-9
    assert abs(realized["lru"] - targets["engine"]["hit_rate"]) < 0.08
    # held from the first token, a call pins nothing while it waits: never more to win
    admitted = doc["ceilings"]["admitted"]
    assert admitted["from"] == "engine" and admitted["inf"] == pytest.approx(realized["inf"])
    assert admitted["lru"] <= admitted["belady"] + 1e-9 <= admitted["inf"] + 2e-9
    table = (out / "compare.md").read_text()
    assert "| engine |" in table
    assert "| full |" in table
    assert "realized (engine)" in table
    assert "realized, held from the first token (engine)" in table


async def test_belady_engine_evicts_by_the_first_targets_sends(tmp_path: Path) -> None:
    workload = small_swarm()
    targets = ("engine", "engine-belady", "engine-deadfirst")
    doc = await run_compare(workload, spec(tmp_path, targets, 0.3))
    out = tmp_path / "cmp"
    engine, belady = doc["targets"]["engine"], doc["targets"]["engine-belady"]
    assert belady["requests"] == engine["requests"] == workload.n_calls()
    assert belady["errors"] == 0
    # the oracle lists every prompt block of the run, hashed as the engine hashes them: the
    # engine found each block it admitted in it
    oracle = json.loads((out / "logs" / "engine-belady-oracle.json").read_text())
    chains = ceiling.BlockChains(workload.block_tokens)
    keys = {k for c in workload.calls() for k in chains.keys(c.pieces())}
    assert len(oracle["blocks"]) == len(keys)
    assert belady["counters"]["kvkeeper_sim_belady_unknown_blocks_total"] == 0
    admitted = belady["counters"]["kvkeeper_sim_belady_prompt_blocks_total"]
    assert admitted >= belady["prompt_tokens"] // workload.block_tokens - workload.n_calls()
    assert "engine's sends" in belady["note"]
    # every target is also set against it
    assert belady["ttft_mean_vs_belady"] == pytest.approx(0.0)
    assert engine["ttft_mean_vs_belady"] == pytest.approx(
        engine["ttft"]["mean"] / belady["ttft"]["mean"] - 1
    )
    table = (out / "compare.md").read_text()
    assert "TTFT mean vs engine-belady" in table
    assert "- engine-belady: evicts by the future uses of engine's sends" in table
    # the dead-first engine reads the same oracle (its own copy) and finds every block in it
    dead = doc["targets"]["engine-deadfirst"]
    assert dead["errors"] == 0 and dead["counters"]["kvkeeper_sim_belady_unknown_blocks_total"] == 0
    assert (out / "logs" / "engine-deadfirst-oracle.json").read_text() == json.dumps(oracle)
    assert "dead blocks first, then LRU" in dead["note"]


async def test_base_names_the_reference_of_every_relative_figure(tmp_path: Path) -> None:
    """With a CPU tier ``engine`` is plain LMCache; ``--base engine-notier`` sets every target
    against vanilla vLLM without it (and the realized Belady stays the first target's)."""
    workload = small_swarm()
    sim = SimConfig(profile="cpu-smollm2", speed=40.0, reply_tokens=1, cpu_blocks=64)
    doc = await run_compare(
        workload,
        spec(tmp_path, ("engine-notier", "engine"), 0.3, sim=sim, base="engine-notier"),
    )
    assert doc["base"] == "engine-notier"
    notier, lmcache = doc["targets"]["engine-notier"], doc["targets"]["engine"]
    assert notier["hit_rate_vs_base_pp"] == 0.0
    # none of the gap closed; None when the run's own timeline left no gap (timing-dependent)
    assert notier["gap_closed"] in (0.0, None)
    assert lmcache["hit_rate_vs_base_pp"] == pytest.approx(
        100 * (lmcache["hit_rate"] - notier["hit_rate"])
    )
    assert lmcache["ttft_mean_vs_base"] == pytest.approx(
        lmcache["ttft"]["mean"] / notier["ttft"]["mean"] - 1
    )
    # the tier's loads are what plain LMCache found beyond the GPU cache
    assert notier["engine"]["tier_loaded_tokens"] == 0
    assert lmcache["engine"]["tier_loaded_tokens"] > 0
    assert doc["ceilings"]["realized"]["from"] == doc["ceilings"]["admitted"]["from"]
    assert doc["ceilings"]["realized"]["from"] == "engine-notier"
    # to the Belady held from the send, and to the one held from the first token
    for key, ceiling_ in (("gap_closed", "realized"), ("gap_closed_first_token", "admitted")):
        gap = doc["ceilings"][ceiling_]["belady"] - notier["hit_rate"]
        expected = (lmcache["hit_rate"] - notier["hit_rate"]) / gap if gap > 1e-9 else None
        assert lmcache[key] == pytest.approx(expected), key
    assert "Base: `engine-notier`" in (tmp_path / "cmp" / "compare.md").read_text()


async def test_base_must_be_a_target_that_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--base 'engine-notier' is not one of the targets"):
        await run_compare(small_swarm(), spec(tmp_path, ("engine",), 0.5, base="engine-notier"))
    assert not (tmp_path / "cmp").exists()  # refused before anything ran or was written


async def test_repeats_report_mean_and_range_over_rounds(tmp_path: Path) -> None:
    workload = small_swarm()
    doc = await run_compare(workload, spec(tmp_path, ("engine", "none", "session"), 0.5, repeats=2))
    out = tmp_path / "cmp"
    assert doc["repeats"] == 2 and doc["rounds"] == ["round1", "round2"]
    rounds = [json.loads((out / r / "compare.json").read_text()) for r in doc["rounds"]]
    # the first target stays first (the realized ceilings are its timeline every round)
    assert [r["ceilings"]["realized"]["from"] for r in rounds] == ["engine", "engine"]
    assert doc["ceilings"]["realized"] == [r["ceilings"]["realized"] for r in rounds]
    assert doc["ceilings"]["admitted"] == [r["ceilings"]["admitted"] for r in rounds]
    for name in ("engine", "none", "session"):
        hits = [r["targets"][name]["hit_rate"] for r in rounds]
        fig = doc["targets"][name]["hit_rate"]
        assert fig["values"] == hits and fig["n"] == 2
        assert fig["mean"] == pytest.approx(sum(hits) / 2)
        assert (fig["min"], fig["max"]) == (min(hits), max(hits))
        assert doc["targets"][name]["errors"]["max"] == 0
    # the paired difference to the same round's baseline: zero for the baseline itself
    assert doc["base"] == "engine"
    assert doc["targets"]["engine"]["hit_rate_vs_base_pp"]["max"] == 0.0
    table = (out / "compare.md").read_text()
    assert "2 rounds" in table and "| session |" in table and "round2 (engine)" in table


def test_aggregate_leaves_out_what_a_round_lacks() -> None:
    def doc(hit: float, ttft_vs_base: float | None) -> dict[str, object]:
        target: dict[str, object] = {"hit_rate": hit, "ttft": {"mean": 1.0, "p90": 2.0}}
        if ttft_vs_base is not None:
            target["ttft_mean_vs_base"] = ttft_vs_base
        ceilings = {"planned": {"C": 1}, "realized": None}
        return {"workload": "w", "params": {}, "setup": {}, "ceilings": ceilings,
                "targets": {"full": target, "vllm-router": {"skipped": "not installed"}}}  # fmt: skip

    agg = aggregate_rounds([doc(0.5, 0.1), doc(0.7, None)], ["round1", "round2"])
    full = agg["targets"]["full"]
    assert full["hit_rate"]["mean"] == pytest.approx(0.6)
    assert full["ttft_mean_vs_base"] == {
        "mean": 0.1,
        "min": 0.1,
        "max": 0.1,
        "n": 1,
        "values": [0.1],
    }
    assert "gap_closed" not in full
    assert agg["targets"]["vllm-router"] == {"skipped": "not installed"}
    assert agg["ceilings"]["realized"] == []


async def test_realized_replay_matches_the_recorded_calls(tmp_path: Path) -> None:
    workload = small_swarm()
    await run_compare(workload, spec(tmp_path, ("engine",), 2.0))
    result = RunResult.load(tmp_path / "cmp" / "engine.json")
    replay = realized_replay(workload, result)
    assert len(replay.reqs) == workload.n_calls()
    assert replay.total_tokens == sum(c.prompt_tokens for c in workload.calls())
    # a pool twice the peak working set never evicts: every policy reaches the infinite cache
    rates = replay_rates(replay, 2 * ceiling.peak_working_set(replay))
    assert rates["lru"] == pytest.approx(rates["inf"])
    assert rates["belady"] == pytest.approx(rates["inf"])
    # held from the first token: the same calls, each starting ttft later (never after its end)
    held = realized_replay(workload, result, from_first_token=True)
    starts = sorted(r.t_start + (r.ttft or 0.0) for r in result.requests)
    assert [r.arrival for r in held.reqs] == pytest.approx(starts)
    assert all(r.arrival <= r.finish for r in held.reqs)
    assert held.total_tokens == replay.total_tokens
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    # no eviction at all: the engine's hit rate is the infinite cache's, up to vLLM never
    # reusing a fully cached prompt's last block
    assert doc["targets"]["engine"]["hit_rate"] == pytest.approx(rates["inf"], abs=0.03)


@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed")
async def test_compare_with_replicas_and_vllm_router(tmp_path: Path) -> None:
    workload = small_swarm()
    doc = await run_compare(
        workload,
        spec(tmp_path, ("round-robin", "vllm-router", "session"), 0.5, replicas=2, router=ROUTER),
    )
    targets = doc["targets"]
    for name in ("round-robin", "vllm-router", "session"):
        assert targets[name]["errors"] == 0, name
        assert targets[name]["requests"] == workload.n_calls()
    # two replicas share the pool: each got half of it
    planned = doc["ceilings"]["planned"]
    assert doc["setup"]["sim"]["num_blocks"] == -(-planned["C"] // 2) + 1
    assert doc["ceilings"]["realized"]["from"] == "round-robin"
    assert targets["round-robin"]["gap_closed"] == pytest.approx(0.0)
