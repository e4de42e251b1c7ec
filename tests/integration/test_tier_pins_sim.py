"""Protected sessions pinned in the offload tier (proxy/tiers.py), on the simulator's
LMCache-shaped tier behind a real proxy.

The GPU pool holds 200 blocks, the tier 400 (50 chunks of 256 tokens). ``budget_share`` 0.1
lets no 63-block session's GPU protection fit, so a flood takes its blocks from the GPU; the
keeper pins its chunks while the tier still holds them, and the rest of the flood, which pushes
everything unpinned out of the tier's LRU, leaves them there."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import proxy.retention
from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import cached, prompt, sim_stack, wait_for

CHUNKS = 7  # a 2,017-token prompt: 7 complete 256-token chunks
TTL_HINT = {"type": "ephemeral", "ttl": 300}
RIG: dict[str, Any] = {"cpu_blocks": 400, "budget_share": 0.1}


async def _flood(st: Any, n: int = 10, base: int = 100) -> None:
    """One 2,017-token request at a time, with room for retention ticks in between."""
    for i in range(n):
        await st.complete(prompt(base + i))
        await asyncio.sleep(0.2)


def _tier(st: Any) -> Any:
    tier = st.sim.engine.cpu
    assert tier is not None
    return tier


def _pinned_once(tier: Any) -> Any:
    """``pins(n)``: a check that the tier holds n pinned chunks, each pinned once."""

    def pins(n: int) -> Any:
        async def check() -> bool:
            return len(tier.pins) == n and all(c == 1 for c in tier.pins.values())

        return check

    return pins


@pytest.mark.parametrize("share", [0.5, 0.0])
async def test_a_session_the_gpu_loses_resumes_from_its_pinned_chunks(
    redis_server: RedisServer, namespace: str, share: float
) -> None:
    async with sim_stack(redis_server.url, namespace, tier_pin_share=share, **RIG) as st:
        await st.complete(prompt(1), {"session_id": "w", "cache_control": TTL_HINT})
        await st.runtime().settle()
        await asyncio.sleep(0.3)
        assert not _tier(st).pins  # resident on the GPU: nothing pinned yet
        await _flood(st)
        kept = _tier(st).lookup_prefix(prompt(1), None)
        resumed = cached(await st.complete(prompt(1), {"session_id": "w"}))
        if share:
            assert await st.metric("kvkeeper_offloads_total") == 1
            assert kept == CHUNKS * 256  # pinned: the flood's LRU went around it
            assert resumed >= CHUNKS * 256  # loaded from the tier, not recomputed
        else:  # the same flood pushed it out of both the pool and the tier
            assert kept == 0 and resumed < 256
            assert await st.metric("kvkeeper_tier_pinned_sessions") == 0


async def test_pins_end_on_resume_and_with_the_protection(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace, tier_pin_share=0.5, **RIG) as st:
        tier = _tier(st)
        pins = _pinned_once(tier)
        await st.complete(prompt(1), {"session_id": "w", "cache_control": TTL_HINT})
        await _flood(st, n=4)
        assert await wait_for(pins(CHUNKS)), tier.pins
        assert await st.metric("kvkeeper_tier_pinned_sessions") == 1
        # the next turn extends the context and is resident again: the old version released
        longer = prompt(1) + prompt(9, 700)
        await st.complete(longer, {"session_id": "w", "cache_control": TTL_HINT})
        assert await wait_for(pins(0)), tier.pins
        await _flood(st, n=4, base=200)  # lost again: its 10 chunks pinned, once each
        assert await wait_for(pins(len(longer) // 256)), tier.pins
        # the protection ends (a one-second TTL runs out): every pin is released
        await st.complete(longer, {"session_id": "w", "cache_control": {"ttl": 1}})
        await _flood(st, n=4, base=300)
        assert await wait_for(pins(0), within=15), tier.pins
        assert await st.metric("kvkeeper_tier_pinned_sessions") == 0


async def test_pins_stay_within_their_share_of_the_tier(
    redis_server: RedisServer, namespace: str
) -> None:
    """A 50-chunk tier at share 0.2 pins 10 chunks: one 7-chunk session, not two."""
    async with sim_stack(redis_server.url, namespace, tier_pin_share=0.2, **RIG) as st:
        await st.complete(prompt(1), {"session_id": "a", "cache_control": {"ttl": 100}})
        await st.complete(prompt(2), {"session_id": "b", "cache_control": {"ttl": 300}})
        await _flood(st, n=4)

        async def one() -> bool:
            return await st.metric("kvkeeper_tier_pinned_sessions") == 1

        assert await wait_for(one)
        # the sooner protection end goes first: "a" is pinned, "b" is not
        assert _tier(st).lookup_prefix(prompt(1), None) == CHUNKS * 256
        assert len(_tier(st).pins) == CHUNKS
        view = await (
            await st.proxy.get("/admin/engines", headers={"Authorization": "Bearer admin-secret"})
        ).json()
        pinned = view["data"][0]["retention"]["tier_pinned"]
        assert _held(pinned) == (1, CHUNKS)
        assert pinned["capacity_chunks"] > 0


def _held(pinned: dict[str, int | None]) -> tuple[int | None, int | None]:
    """(sessions, chunks) of a ``TierKeeper.pinned`` view."""
    return pinned["sessions"], pinned["chunks"]


async def test_pins_a_crashed_replica_left_are_adopted_and_released_by_the_next(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMCache pins have no TTL. The replica driving retention crashes holding a pin; the one
    that takes over its lease finds the pin in the Redis ledger and releases it when the
    session no longer needs it, as if it had pinned it itself."""
    monkeypatch.setattr(proxy.retention, "LEASE_TTL_S", 1.0)  # a quicker takeover
    async with sim_stack(redis_server.url, namespace, replicas=2, tier_pin_share=0.5, **RIG) as st:
        tier = _tier(st)
        pins = _pinned_once(tier)
        await st.complete(prompt(1), {"session_id": "w", "cache_control": TTL_HINT})
        await _flood(st, n=4)
        assert await wait_for(pins(CHUNKS)), tier.pins
        retentions = [st.runtime(i).retention for i in range(2)]
        states = [next(iter(r.engines.values())) for r in retentions]
        name = states[0].engine.name
        leader = next(i for i, es in enumerate(states) if es.leader_token)
        crashed, survivor = retentions[leader], retentions[1 - leader]
        assert _held(crashed.tiers.pinned(name)) == (1, CHUNKS)
        assert len(await crashed.store.tier_pins(name)) == 1  # the ledger
        # the crash: its workers end, its memory is gone, nothing is released
        for task in crashed._tasks:
            task.cancel()
        await asyncio.wait(crashed._tasks, timeout=5)
        crashed.tiers._state.clear()

        async def took_over() -> bool:
            return bool(states[1 - leader].leader_token)

        assert await wait_for(took_over), "the other replica never took the lease"
        assert _held(survivor.tiers.pinned(name)) == (1, CHUNKS)
        assert len(tier.pins) == CHUNKS  # adopted, not pinned a second time
        # the session resumes: resident again, its pinned version is released by the survivor
        await st.complete(prompt(1), {"session_id": "w", "cache_control": {"ttl": 1}}, i=1 - leader)
        assert await wait_for(pins(0), within=15), tier.pins
        assert await survivor.store.tier_pins(name) == {}
