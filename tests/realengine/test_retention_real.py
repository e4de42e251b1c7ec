"""Retention through kvkeeper on the real vLLM: an ``agent_hint`` TTL keeps a session's prefix
resident through a flood larger than the 200-block pool; without a TTL the same session is evicted.

The session is a 2,017-token prompt (63 full blocks) sent through the proxy; the flood is 8
unrelated 2,000-token prompts (500 blocks, 2.5 pools) sent through the proxy without hints. The
two variants run as two tests, each from an empty prefix cache (the suite's autouse reset).
The touches kvkeeper's retention worker sends are read from its own Prometheus counters.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from proxy.keys import SessionKey
from proxy.runtime import RUNTIME
from tests.helpers.redis_server import RedisServer
from tests.realengine.conftest import VLLMEngine
from tests.realengine.test_proxy_real import (
    BLOCK,
    Client,
    metric,
    real_proxy,
    session_json,
    wait_for,
)
from tests.realengine.test_vllm_adapter import random_tokens

pytestmark = pytest.mark.realengine
log = logging.getLogger(__name__)

SESSION_TOKENS = 2017  # 63 full blocks + 1 token: a repeat can hit all 63
FULL_BLOCKS = SESSION_TOKENS // BLOCK
FLOOD = 8
FLOOD_TOKENS = 2000


async def complete(client: Client, tokens: list[int], hint: dict[str, Any] | None) -> Any:
    body: dict[str, Any] = {"model": "smol", "prompt": tokens, "max_tokens": 1}
    if hint is not None:
        body["agent_hint"] = hint
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


def cached(answer: Any) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def run_variant(client: Client, ttl: float | None) -> dict[str, float]:
    """Session, flood, resume; every figure the assertions need."""
    tokens = random_tokens(4242, SESSION_TOKENS)
    hint: dict[str, Any] = {"session_id": "agent-1"}
    if ttl is not None:
        hint["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    first = await complete(client, tokens, hint)
    assert cached(first) == 0
    retention = client.app[RUNTIME].retention
    assert retention is not None

    async def known() -> bool:
        return (
            len(await retention.blocks.blocks_of(SessionKey("default", "agent-1"))) == FULL_BLOCKS
        )

    assert await wait_for(known), "retention never learned the session's 63 blocks"
    flood_tokens = 0
    started = time.perf_counter()
    for i in range(FLOOD):
        answer = await complete(client, random_tokens(9000 + i, FLOOD_TOKENS), None)
        flood_tokens += int(answer["usage"]["prompt_tokens"])
    flood_s = time.perf_counter() - started
    started = time.perf_counter()
    resumed = await complete(client, tokens, {"session_id": "agent-1"})
    await retention.stop()  # no touch under way or to come: both counts below are final
    return {
        "resume_cached": cached(resumed),
        "resume_s": time.perf_counter() - started,
        "flood_tokens": flood_tokens,
        "flood_s": flood_s,
        # touches the engine served: on time, or late (past 1 s behind a flood prefill; a
        # touch is never aborted, so a late one still refreshes the prefix)
        "late_touches": (late := await metric(client, "kvkeeper_touches_total", 'outcome="late"')),
        "touches": late + await metric(client, "kvkeeper_touches_total", 'outcome="ok"'),
        "touch_prompt": await metric(client, "kvkeeper_touch_prompt_tokens_total"),
        "recomputed": await metric(client, "kvkeeper_touch_recomputed_tokens_total"),
        "session_touches": (await session_json(client, "agent-1"))["counters"]["touches"],
    }


async def test_ttl_session_survives_a_flood_larger_than_the_pool(
    vllm_engine: VLLMEngine, redis_server: RedisServer, namespace: str
) -> None:
    # the CPU engine prefills each flood prompt in one ~2 s step; a touch that arrives during one
    # waits for it (it is never abandoned) and refreshes the prefix when it is served
    async with real_proxy(vllm_engine, redis_server.url, namespace) as client:
        got = await run_variant(client, ttl=600)
    log.info("protected: %s", got)
    assert got["flood_tokens"] == FLOOD * FLOOD_TOKENS, got
    assert got["flood_tokens"] / BLOCK > 2 * vllm_engine.num_blocks, got  # the flood: 2.5 pools
    assert got["resume_cached"] >= 0.95 * FULL_BLOCKS * BLOCK, got
    assert got["touches"] >= 1 and got["session_touches"] == got["touches"], got
    # a touch re-sends the prefix and recomputes only its uncached tail
    assert got["recomputed"] < 0.02 * got["flood_tokens"], got


async def test_same_session_without_ttl_is_evicted_by_the_flood(
    vllm_engine: VLLMEngine, redis_server: RedisServer, namespace: str
) -> None:
    async with real_proxy(vllm_engine, redis_server.url, namespace) as client:
        got = await run_variant(client, ttl=None)
    log.info("unprotected: %s", got)
    assert got["flood_tokens"] == FLOOD * FLOOD_TOKENS, got
    assert got["touches"] == 0 and got["recomputed"] == 0, got
    assert got["resume_cached"] == 0, got
