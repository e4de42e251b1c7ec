"""The engine-time TTFT through the real simulator: it reports its own time to the first token
(``usage.sim_engine_ttft_s``, ``usage.sim_speed``), the load generator records it, and the
summary scales the engine's part back to the profile's speed."""

from __future__ import annotations

import pytest

from loadgen.metrics import engine_time_ttft, summarize
from loadgen.runner import RunOptions, Target, run_workload
from loadgen.sim.server import SimConfig, run_simulator_process
from loadgen.workloads import build_workload
from loadgen.workloads.base import Workload
from loadgen.workloads.hints import HintPolicy


def _swarm() -> Workload:
    return build_workload(
        "swarm",
        {"users": 2, "agents": 3, "token_scale": 0.1, "arrival_rate": 4.0, "pause_cap": 0.5,
         "max_dispatches": 4},
    )  # fmt: skip


@pytest.mark.parametrize("speed", [4.0, 1.0])
async def test_the_simulator_reports_its_own_time_to_the_first_token(speed: float) -> None:
    config = SimConfig(profile="cpu-smollm2", speed=speed, reply_tokens=2, num_blocks=4096)
    async with run_simulator_process(config) as sim:
        target = Target(sim.url, "sim", hints=HintPolicy(mode="none"), api="completions-ids")
        options = RunOptions(concurrency=8, time_scale=0.1, progress=False)
        result = await run_workload(_swarm(), target, options)
    ok = [r for r in result.requests if r.error is None]
    assert ok and len(ok) == len(result.requests)
    for r in ok:
        assert r.ttft is not None and r.engine_ttft is not None
        assert r.engine_speed == speed
        # the engine's part is inside the client's: arrival after the send, first token
        # before the chunk that carries it reaches the client
        assert 0.0 < r.engine_ttft <= r.ttft
        assert engine_time_ttft(r) == pytest.approx(r.ttft + (speed - 1.0) * r.engine_ttft)
    s = summarize(result)
    if speed == 1.0:
        assert s["ttft_engine_time"] == s["ttft"]
    else:  # the profile's prefill of hundreds of tokens on a CPU engine: well above wall time
        assert s["ttft_engine_time"]["mean"] > s["ttft"]["mean"]
