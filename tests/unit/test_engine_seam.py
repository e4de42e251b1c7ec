"""Retention and placement through the engine seam alone: an in-memory engine adapter
(tests/helpers/memory_engine.py) instead of the simulator, a real Redis for the session store."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from policy.prefix_index import hash_chain
from proxy.completions import CompletionWriter
from proxy.engine_state import EngineState
from proxy.hints import parse_request
from proxy.keys import SessionKey
from proxy.metrics import Metrics
from proxy.placement import PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS, Affinity, Placer
from proxy.retention import Retention
from proxy.settings import EngineSpec, Limits, PlacementSettings, RetentionSettings, TierSettings
from proxy.store import SessionStore, Usage
from proxy.tiers import TierKeeper
from proxy.upstream import Engine, EnginePool
from tests.helpers.memory_engine import MemoryEngine
from tests.helpers.redis_server import RedisServer

ROUTE = "/v1/completions"


def engine(name: str, **kw: Any) -> Engine:
    spec = EngineSpec(url=f"http://{name}:1", name=name, kind="memory")
    return Engine(spec, MemoryEngine(name=name, **kw))


def memory(e: Engine) -> MemoryEngine:
    adapter = e.adapter
    assert isinstance(adapter, MemoryEngine)
    return adapter


@pytest.fixture
async def store(redis_server: RedisServer, namespace: str) -> AsyncIterator[SessionStore]:
    redis = Redis.from_url(redis_server.url)
    yield SessionStore(redis, Limits(), namespace=namespace)
    await redis.aclose()


async def test_signals_follow_the_engines_events_and_metrics() -> None:
    e = engine("a")
    await e.signals.connect(discover_cache=True)
    e.signals.subscribe()  # as the lease holder does
    assert e.signals.mode == "events"
    tokens = list(range(40))  # 10 blocks of 4
    memory(e).serve(tokens)
    blocks = e.adapter.hash_blocks(tokens)
    assert e.signals.resident_prefix(blocks) == 10
    await e.signals.scrape(time.time(), max_age_s=0)
    assert e.signals.load is not None and e.signals.load.pool_blocks == 64
    assert e.signals.pool_tokens() == 64 * 4
    memory(e).evict_all()
    assert e.signals.resident(blocks) == 0


async def test_placement_follows_the_resident_prefix_then_the_prompt() -> None:
    a, b = engine("a"), engine("b")
    pool = EnginePool([a, b], None, Metrics())  # type: ignore[arg-type]
    for e in (a, b):
        await e.signals.connect(discover_cache=True)
        e.signals.subscribe()  # as the lease holder does
        await e.signals.scrape(time.time(), max_age_s=0)
    tokens = list(range(100, 140))
    memory(b).serve(tokens)  # b holds the session's prefix
    key = SessionKey("t", "s")
    known = {key: tuple(b.adapter.hash_blocks(tokens))}
    placer = Placer(pool, PlacementSettings(), Metrics(), known.get)  # type: ignore[arg-type]
    for _ in range(4):  # whatever the round robin says
        assert placer.order(Affinity(None, None), key)[0] is b
    assert placer.uncached_estimate(b, 4 * 40, key) < placer.uncached_estimate(a, 4 * 40, key)

    body = json.dumps({"prompt": "x" * 4000}).encode()
    chain = hash_chain(body, PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS)
    first = placer.order(None, None, chain)[0]
    placer.prefill_started(first.name, len(body), chain)
    placer.prefill_done(first.name, placer.prefill_pending[first.name])
    for _ in range(4):  # the same prompt follows its chunks
        assert placer.order(None, None, chain)[0] is first


async def _protected(store: SessionStore, e: Engine, sid: str, tokens: list[int]) -> None:
    """A session protected for 5 minutes whose last request sent ``tokens`` to ``e``."""
    hint = {"session_id": sid, "cache_control": {"type": "ephemeral", "ttl": 300}}
    body = {"prompt": tokens, "agent_hint": hint}
    raw = json.dumps(body).encode()
    parsed = parse_request(ROUTE, {}, raw, Limits())
    assert parsed.hint is not None
    await store.upsert("t", parsed.hint, time.time())
    writer = CompletionWriter(store)
    usage = Usage(prompt_tokens=len(tokens), cached_tokens=0)
    writer.add(
        "t", sid, engine=e.name, usage=usage, route=ROUTE, body=parsed.body,
        breakpoint=None, block_offset=None, now=time.time(),
    )  # fmt: skip
    await writer.close()
    memory(e).serve(tokens)


async def test_a_protected_session_is_touched_once_the_allocation_front_passes_it(
    store: SessionStore,
) -> None:
    e = engine("a")
    es = EngineState(e)
    metrics = Metrics()
    retention = Retention(
        store, [es], RetentionSettings(), metrics, tiers=TierKeeper(store, TierSettings(), metrics)
    )
    await es.signals.connect(discover_cache=True)
    es.signals.subscribe()  # as the lease holder does
    tokens = list(range(1000, 1040))  # 10 blocks
    await _protected(store, e, "s", tokens)
    now = time.time()
    await retention.tick(es, now)  # learns the blocks; nothing is due yet
    assert await retention.blocks.blocks_of(SessionKey("t", "s")) == tuple(
        e.adapter.hash_blocks(tokens)
    )
    assert memory(e).touches == []
    for i in range(8):  # other traffic: 40 new blocks, the front passes the session
        memory(e).serve(list(range(10_000 + 20 * i, 10_020 + 20 * i)))
    await retention.tick(es, time.time())
    for task in retention.touches.tasks():
        await task
    (touch,) = memory(e).touches
    assert touch == tokens  # its resident blocks (a prompt of whole blocks: no token past them)
    assert es.signals.overhead.spent == 1  # it recomputed that one token
    await retention.stop()
