"""Protected sessions pinned in the offload tier (proxy/tiers.py), on the simulator's
LMCache-shaped tier behind a real proxy.

The tier in these tests is as large as the GPU pool (200 blocks, 25 chunks of 256 tokens): under
LRU alone it holds what the pool holds, and a flood pushes a paused session out of both."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import cached, prompt, sim_stack, wait_for

CHUNKS = 7  # a 2,017-token prompt: 7 complete 256-token chunks
TTL_HINT = {"type": "ephemeral", "ttl": 300}


async def _flood(st: Any, n: int = 8, base: int = 100) -> None:
    for i in range(n):
        await st.complete(prompt(base + i))


def _tier(st: Any) -> Any:
    tier = st.sim.engine.cpu
    assert tier is not None
    return tier


@pytest.mark.parametrize("share", [0.5, 0.0])
async def test_a_pinned_session_resumes_from_the_tier_without_touches(
    redis_server: RedisServer, namespace: str, share: float
) -> None:
    async with sim_stack(redis_server.url, namespace, cpu_blocks=200, tier_pin_share=share) as st:
        await st.complete(prompt(1), {"session_id": "w", "cache_control": TTL_HINT})
        if share:

            async def pinned() -> bool:
                return await st.metric("kvkeeper_tier_pinned_sessions") == 1

            assert await wait_for(pinned), "the protected session was never pinned"
            assert await st.metric("kvkeeper_tier_pinned_chunks") == CHUNKS
            assert await st.metric("kvkeeper_offloads_total") == 1
        await _flood(st)
        kept = _tier(st).lookup_prefix(prompt(1), None)
        if share:
            # the flood took it from the GPU (no touches for a session the tier holds) and the
            # tier's LRU part, not from its pins: the resume loads it instead of recomputing
            assert kept == CHUNKS * 256
            assert await st.metric("kvkeeper_touches_total", label='outcome="ok"') == 0
            assert cached(await st.complete(prompt(1), {"session_id": "w"})) >= CHUNKS * 256
        else:  # no pins: GPU touches kept it (and so refreshed its chunks in the tier)
            assert await st.metric("kvkeeper_touches_total", label='outcome="ok"') >= 1
            assert await st.metric("kvkeeper_tier_pinned_sessions") == 0
            assert not _tier(st).pins


async def test_pins_follow_the_context_and_end_with_the_protection(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace, cpu_blocks=200, tier_pin_share=0.5) as st:
        tier = _tier(st)
        await st.complete(prompt(1), {"session_id": "w", "cache_control": TTL_HINT})

        async def pins(n: int) -> Any:
            async def check() -> bool:
                return len(tier.pins) == n and all(c == 1 for c in tier.pins.values())

            return check

        assert await wait_for(await pins(CHUNKS)), tier.pins
        # the next turn extends the context: its 10 chunks pinned once each, the old version
        # released (the 7 chunks both cover stay pinned throughout, at count 1 after)
        longer = prompt(1) + prompt(9, 700)
        await st.complete(longer, {"session_id": "w", "cache_control": TTL_HINT})
        assert await wait_for(await pins(len(longer) // 256)), tier.pins
        # the protection ends (a short TTL runs out): every pin is released
        await st.complete(longer, {"session_id": "w", "cache_control": {"ttl": 1}})
        assert await wait_for(await pins(0), within=15), tier.pins
        assert await st.metric("kvkeeper_tier_pinned_sessions") == 0


async def test_pins_stay_within_their_share_of_the_tier(
    redis_server: RedisServer, namespace: str
) -> None:
    """A 25-chunk tier at share 0.5 pins 12 chunks: one 7-chunk session, not two."""
    async with sim_stack(redis_server.url, namespace, cpu_blocks=200, tier_pin_share=0.5) as st:
        await st.complete(prompt(1), {"session_id": "a", "cache_control": {"ttl": 100}})
        await st.complete(prompt(2), {"session_id": "b", "cache_control": {"ttl": 300}})

        async def one() -> bool:
            return await st.metric("kvkeeper_tier_pinned_sessions") == 1

        assert await wait_for(one)
        # the sooner protection end goes first: "a" is pinned, "b" kept by touches instead
        assert _tier(st).lookup_prefix(prompt(1), None) == CHUNKS * 256
        assert len(_tier(st).pins) == CHUNKS
        view = await (
            await st.proxy.get("/admin/engines", headers={"Authorization": "Bearer admin-secret"})
        ).json()
        assert view["data"][0]["retention"]["tier_pinned"] == {"sessions": 1, "chunks": CHUNKS}
