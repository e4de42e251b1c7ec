"""Retention's work shares the proxy's event loop: learning a long context's block ids (decoding
the recorded context, hashing thousands of blocks) hands the loop back in short stretches
instead of holding every request for the whole of it."""

from __future__ import annotations

import asyncio
import time

from proxy.context import decode_context
from proxy.keys import SessionKey
from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import prompt, sim_stack

LONG = 100_000  # tokens of one agent context: 3,125 blocks of 32


async def _max_lag(work: object) -> float:
    """The longest the loop went without running a ticker that asks for it every 1 ms."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    gaps.clear()
    await work  # type: ignore[misc]
    done.set()
    await task
    return max(gaps, default=0.0)


async def test_learning_a_long_contexts_blocks_yields_the_loop(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace, num_blocks=4000, tick_s=60.0) as st:
        sid, key = "long", SessionKey("default", "long")
        await st.complete(prompt(1, LONG), {"session_id": sid, "cache_control": {"ttl": 300}})
        retention = st.runtime().retention
        assert retention is not None
        await st.runtime().settle()
        es = next(iter(retention.engines.values()))
        blob = await retention.store.get_context(*key)
        assert blob is not None
        # what the same work takes in one stretch: decode, then hash every block at once (before
        # the slices, the longest lag was 1.2-1.4 times this; with them, under half)
        started = time.perf_counter()
        tokens = decode_context(blob).body["prompt"]
        whole = es.adapter.hash_blocks(tokens)
        one_stretch = time.perf_counter() - started
        lags = []
        for _ in range(3):  # the least of three: an OS preemption is not the code's stretch
            retention.blocks.forget(key)
            await retention.store.set_blocks(*key, b"")  # nothing stored: learned anew
            session = await retention.store.get(*key)
            assert session is not None
            learned: list[tuple[int, ...]] = []

            async def learn() -> None:
                learned.append(await retention.blocks.blocks_of(key, session))  # noqa: B023

            lags.append(await _max_lag(learn()))
            assert list(learned[0]) == whole and len(whole) == LONG // 32
        print(f"max loop lag {min(lags) * 1e3:.1f} ms, one stretch {one_stretch * 1e3:.1f} ms")
        assert min(lags) < 0.75 * one_stretch, (lags, one_stretch)
