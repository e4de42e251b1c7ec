"""The simulator against real vLLM: same prompts, same pool -> same cached tokens, same events.

One fixed sequence of token-id prompts (shared prefixes, a block-aligned full repeat, a salted
pair, floods that overflow the 200-block pool) is sent one at a time, ``max_tokens: 1``, to the
real engine and to a simulator with the same geometry. Per request ``cached_tokens`` must match,
and the block hashes in both KV-event streams (stored and removed, in order) must be identical.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from adapters.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from loadgen.sim import SimConfig, run_simulator
from tests.realengine.conftest import VLLMEngine

pytestmark = pytest.mark.realengine


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    salt: str | None = None


def workload(seed: int = 6) -> list[Prompt]:
    """~15 prompts, ~17K tokens through a 199-block (6,368-token) pool."""
    rng = random.Random(seed)

    def r(n: int) -> list[int]:
        return [rng.randrange(100, 49_000) for _ in range(n)]

    a, b, c = r(1000), r(1200), r(700)
    return [
        Prompt(a + r(37)),
        Prompt(a + r(50)),  # shares a's 31 full blocks
        Prompt(a[:640]),  # block-aligned and fully cached: the last block is recomputed
        Prompt(b + r(10)),
        Prompt(c + r(300)),
        Prompt(r(1500)),  # floods: the pool overflows from here on
        Prompt(r(1500)),
        Prompt(a + r(20)),  # what is left of a: the head of its chain
        Prompt(r(1800)),
        Prompt(b + r(5)),
        Prompt(a + r(10), salt="tenant-1"),
        Prompt(a + r(12), salt="tenant-1"),  # salted chain shared within the tenant only
        Prompt(c + r(64)),
        Prompt(r(2000)),
        Prompt(a + r(40)),
    ]


@dataclass
class Run:
    cached: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)  # every event map, as sent
    cleared: int = 0


async def drive(url: str, events_endpoint: str, model: str, prompts: list[Prompt]) -> Run:
    """Reset, subscribe, send the prompts one by one, collect usage and event hashes."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    sub.connect(events_endpoint)
    run = Run()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/reset_prefix_cache") as resp:
                assert resp.status == 200
            await asyncio.sleep(1.0)  # slow joiner; let the reset's batch arrive
            await _drain(sub, run, quiet=0.5)
            run.stored.clear()
            run.removed.clear()
            run.raw.clear()
            for p in prompts:
                run.cached.append(await _complete(http, url, model, p))
            await _drain(sub, run, quiet=1.5)
    finally:
        sub.close()
        ctx.term()
    return run


async def _complete(http: aiohttp.ClientSession, url: str, model: str, p: Prompt) -> int:
    body: dict[str, Any] = {"model": model, "prompt": p.tokens, "max_tokens": 1}
    if p.salt:
        body["cache_salt"] = p.salt
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    return int(data["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


async def _drain(sub: zmq.asyncio.Socket, run: Run, quiet: float) -> None:
    while True:
        try:
            frames = await asyncio.wait_for(sub.recv_multipart(), quiet)
        except TimeoutError:
            return
        # AllBlocksCleared from the opening reset rides on the next step's batch (vLLM
        # publishes a step's events after it runs): left out of the field-by-field comparison
        run.raw.extend(e for e in msgpack.unpackb(frames[-1])[1] if e["type"] != "AllBlocksCleared")
        for event in decode_batch(frames[-1]).events:
            if isinstance(event, BlockStored) and event.medium == "GPU":
                run.stored.extend(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium == "GPU":
                run.removed.extend(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                run.cleared += 1


def _match_rate(a: list[Any], b: list[Any]) -> float:
    same = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    return same / max(len(a), len(b), 1)


async def test_simulator_matches_real_vllm(vllm_engine: VLLMEngine) -> None:
    prompts = workload()
    real = await drive(vllm_engine.url, vllm_engine.events_endpoint, vllm_engine.model, prompts)
    config = SimConfig(
        num_blocks=vllm_engine.num_blocks,
        block_size=vllm_engine.block_size,
        hash_seed=vllm_engine.hash_seed,
        model=vllm_engine.model,
        profile="instant",
        max_model_len=4096,
    )
    async with run_simulator(config) as sim:
        simulated = await drive(sim.url, sim.events_endpoint, sim.config.model, prompts)

    rate = _match_rate(real.cached, simulated.cached)
    print(f"\ncached_tokens per request (real): {real.cached}")
    print(f"cached_tokens per request (sim):  {simulated.cached}")
    print(f"cached_tokens match rate: {rate:.0%} of {len(prompts)} requests")
    print(
        f"stored hashes: real {len(real.stored)}, sim {len(simulated.stored)}, "
        f"match {_match_rate(real.stored, simulated.stored):.0%}; removed hashes: "
        f"real {len(real.removed)}, sim {len(simulated.removed)}, "
        f"match {_match_rate(real.removed, simulated.removed):.0%}"
    )
    dump = Path("results") / "sim_fidelity_events.json"
    dump.parent.mkdir(exist_ok=True)
    dump.write_text(json.dumps({"real": real.raw, "sim": simulated.raw, "cached_real": real.cached,
                                "cached_sim": simulated.cached}))  # fmt: skip
    same_maps = _match_rate(real.raw, simulated.raw)
    print(f"event maps identical (all fields): {same_maps:.0%} of {len(real.raw)}")
    if real.raw != simulated.raw:
        pairs = enumerate(zip(real.raw, simulated.raw, strict=False))
        first = next((i for i, (x, y) in pairs if x != y), None)
        if first is not None:
            print(f"first differing event #{first}:")
            print(f" real {real.raw[first]}")
            print(f" sim  {simulated.raw[first]}")
    assert real.removed, "the workload must overflow the pool"
    assert real.cached == simulated.cached
    assert real.stored == simulated.stored
    assert real.removed == simulated.removed
    assert real.raw == simulated.raw
