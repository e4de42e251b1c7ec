"""The retention tick's work follows the due and changed sessions, not the protected ones.

A real Redis, the in-process engine: N idle protected sessions (just used) and three
whose last use was 2,000 s ago (past the horizon, still resident). The first tick loads and learns everyone; from then on a tick
looks at the sessions that changed (the three touched) and walks the due order's prefix only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from adapters.base import CacheConfig
from proxy.completions import CompletionWriter
from proxy.engine_state import EngineState
from proxy.hint_model import Hint
from proxy.metrics import Metrics
from proxy.retention import Retention
from proxy.settings import EngineSpec, Limits, RetentionSettings, TierSettings
from proxy.store import SessionStore, Usage
from proxy.tiers import TierKeeper
from proxy.upstream import Engine
from tests.helpers.memory_engine import MemoryEngine
from tests.helpers.redis_server import RedisServer

ROUTE = "/v1/completions"


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def _tick_work(redis: Redis, namespace: str, idle: int) -> tuple[list[int], int]:
    """Sessions examined by three ticks, and the touches sent."""
    store = SessionStore(redis, Limits(max_sessions_per_tenant=100_000), namespace=namespace)
    memory = MemoryEngine(name="a", cache=CacheConfig(block_size=4, num_blocks=1_000_000))
    e = Engine(EngineSpec(url="http://a:1", name="a", kind="memory"), memory)
    es, metrics = EngineState(e), Metrics()
    retention = Retention(
        store, [es], RetentionSettings(), metrics, tiers=TierKeeper(store, TierSettings(), metrics)
    )
    await es.signals.connect(discover_cache=True)
    es.signals.subscribe()  # as the lease holder does
    # one eviction seen at 600 s: the horizon (touch every 300 s) whatever the pool's size
    es.signals.estimator.observe_eviction(600.0, time.time())
    now = time.time()
    writer = CompletionWriter(store)
    for start in range(0, idle + 3, 500):
        names = [f"s{i}" for i in range(start, min(idle + 3, start + 500))]
        due = {n: now - 2000 if n in ("s0", "s1", "s2") else now for n in names}
        await asyncio.gather(
            *(store.upsert("t", Hint(session_id=n, ttl_s=3600), at) for n, at in due.items())
        )
        for n in names:
            tokens = [int(n[1:]) + 1, 2, 3, 4, 5, 6, 7, 8]  # two blocks of its own
            body = json.dumps({"prompt": tokens}).encode()
            usage = Usage(prompt_tokens=len(tokens), cached_tokens=0)
            writer.add(
                "t", n, engine="a", usage=usage, route=ROUTE, body=body,
                breakpoint=None, block_offset=None, now=due[n],
            )  # fmt: skip
            memory.serve(tokens)
    await writer.close()
    examined = []
    for _ in range(3):
        await retention.tick(es, time.time())
        for task in retention.touches.tasks():
            await task
        examined.append(retention._driven["a"].examined)
    await retention.stop()
    return examined, len(memory.touches)


async def test_tick_work_stays_bounded_as_idle_protected_sessions_grow(
    redis: Redis, namespace: str
) -> None:
    small, touched_small = await _tick_work(redis, f"{namespace}:s", 100)
    large, touched_large = await _tick_work(redis, f"{namespace}:l", 10_000)
    assert touched_small == touched_large == 3  # the three due sessions, once each
    assert small[0] >= 103 and large[0] >= 10_003  # the first tick loads and learns everyone
    # later ticks: the three touched sessions changed (applied, re-learned), the due order's
    # first entry peeked; the same work at 100 and at 10,000 idle sessions
    assert small[1:] == large[1:]
    assert max(large[1:]) <= 10
