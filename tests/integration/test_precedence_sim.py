"""On the simulator: when the overhead credit is short, the touch of a session the client
protected goes first, and a session protected by kvkeeper's guess (policy/returns.py) is
touched only with the credit the client's sessions leave."""

from __future__ import annotations

import time

from policy.overhead import OverheadBudget, OverheadConfig
from proxy.keys import SessionKey
from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import prompt, sim_stack, wait_for


async def test_a_guessed_session_touches_only_with_the_credit_clients_leave(
    redis_server: RedisServer, namespace: str
) -> None:
    # one tick at start, then none: this test drives the touch step itself
    async with sim_stack(redis_server.url, namespace, tick_s=3600.0) as st:
        rt = st.runtime()
        retention, store = rt.retention, rt.store
        assert retention is not None and store is not None
        es = next(iter(retention.engines.values()))
        await st.complete(prompt(1), {"session_id": "client", "cache_control": {"ttl": 300}})
        await st.complete(prompt(2), {"session_id": "guess"})
        await rt.settle()
        assert await store.protect("default", "guess", time.time(), 300, guessed=True)
        sessions, blocks = [], {}
        for sid in ("guess", "client"):  # the guess listed first
            s = await store.get("default", sid)
            assert s is not None and s.guessed == (sid == "guess")
            key = SessionKey("default", sid)
            blocks[key] = await retention.blocks.blocks_of(key, s)
            assert blocks[key]
            sessions.append(s)

        async def resident() -> bool:
            return all((es.signals.resident(b) or 0) > 0 for b in blocks.values())

        assert await wait_for(resident), "the engine's KV events never showed the prefixes"
        # credit for two touches at 10 tokens, but a guess must leave one client touch (10)
        es.signals.overhead = OverheadBudget(
            OverheadConfig(share=0.01, burst_tokens=100), touch_estimate=10.0
        )
        es.signals.overhead.credit = 25.0
        retention._touch(es, sessions, blocks, 0.1, time.time() + 5.0, clients=1)
        assert es.in_flight == {SessionKey("default", "client")}
        yielded = 'outcome="yielded"'  # a guess declined: its touch and the reserve not covered
        assert await st.metric("kvkeeper_touches_total", label=yielded) == 1
        assert await st.metric("kvkeeper_touches_total", label='outcome="over_budget"') == 0

        async def settled() -> bool:
            return not es.in_flight

        assert await wait_for(settled), "the client's touch never ended"
        # with no client session left to serve, the guess spends the credit
        retention._touch(es, sessions[:1], blocks, 0.1, time.time() + 5.0, clients=0)
        assert es.in_flight == {SessionKey("default", "guess")}
        assert await wait_for(settled)
