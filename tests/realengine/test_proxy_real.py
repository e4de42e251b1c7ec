"""kvkeeper in front of the real vLLM: chat, streaming and Anthropic messages pass through, and the
session counters kvkeeper keeps in Redis add up to exactly the usage the client saw.

The proxy runs in-process (aiohttp TestServer on an ephemeral port) against the suite's vLLM, a
real Redis and the engine's real KV events. The helpers here (``real_proxy``, ``metric``,
``session_json``, ``wait_for``) are shared with test_retention_real.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import create_app
from proxy.settings import load_settings
from tests.helpers.redis_server import RedisServer
from tests.realengine.conftest import VLLMEngine
from tests.realengine.test_vllm_adapter import chat_body

pytestmark = pytest.mark.realengine
log = logging.getLogger(__name__)

ADMIN = {"Authorization": "Bearer admin-secret"}
Client = TestClient[Any, Any]
BLOCK = 32


@asynccontextmanager
async def proxy_for(
    engine: dict[str, Any], redis_url: str, namespace: str, **retention: Any
) -> AsyncIterator[Client]:
    """A kvkeeper app on an ephemeral port in front of one engine (an ``EngineSpec`` mapping)."""
    settings = load_settings(
        engines=[engine],
        redis_url=redis_url,
        namespace=namespace,
        admin_token="admin-secret",
        expose_engines=True,
        health_interval_s=60,
        retention={"tick_s": 0.1, "hash_seed": "0", **retention},
    )
    client: Client = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@asynccontextmanager
async def real_proxy(
    engine: VLLMEngine, redis_url: str, namespace: str, **retention: Any
) -> AsyncIterator[Client]:
    """kvkeeper in front of the suite's vLLM, its KV events configured."""
    spec = {"url": engine.url, "events": engine.events_endpoint}
    async with proxy_for(spec, redis_url, namespace, hash_seed=engine.hash_seed, **retention) as c:
        yield c


async def metric(client: Client, name: str, label: str = "") -> float:
    """The sum of every sample of ``name`` (with ``label``, e.g. ``outcome="ok"``) on /metrics."""
    text = await (await client.get("/metrics")).text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def session_json(client: Client, sid: str, within_s: float = 10.0) -> dict[str, Any]:
    """The admin view of ``sid``. A 503 ``store_unavailable`` is asked again: with vLLM on the
    same two cores, one Redis call can outlast the store's 0.5 s timeout, and the store then
    fails fast for its 1 s cooldown (the documented fail-open answer, not what these tests test)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        resp = await client.get(f"/admin/sessions/{sid}", headers=ADMIN)
        if resp.status != 503 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.25)
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], within: float = 15.0, step: float = 0.1
) -> bool:
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(step)
    return False


async def counters_after(client: Client, sid: str, requests: int) -> dict[str, int]:
    """The session's counters once ``requests`` completions are recorded (off the hot path)."""

    async def recorded() -> bool:
        return int((await session_json(client, sid))["counters"]["requests"]) >= requests

    assert await wait_for(recorded), f"session {sid} never recorded {requests} requests"
    return dict((await session_json(client, sid))["counters"])


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def full_block_hit(prompt_tokens: int) -> int:
    """What a repeat of an identical prompt can hit: every full block short of the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


@pytest.fixture
async def proxy(
    vllm_engine: VLLMEngine, redis_server: RedisServer, namespace: str
) -> AsyncIterator[Client]:
    async with real_proxy(vllm_engine, redis_server.url, namespace) as client:
        yield client


async def test_chat_streamed_and_not_with_session_counters_equal_to_usage(proxy: Client) -> None:
    # ignore_eos (a vLLM extension, passed through): exactly 4 tokens, finish_reason "length"
    body = {**chat_body("passthrough", 1200), "max_tokens": 4, "ignore_eos": True}
    body["agent_hint"] = {"session_id": "chat-1"}

    resp = await proxy.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-KVKeeper-Hint"].startswith("accepted")
    assert resp.headers["X-KVKeeper-Engine"]
    first = await resp.json()
    assert first["object"] == "chat.completion"
    assert len(first["choices"]) == 1 and first["choices"][0]["message"]["role"] == "assistant"
    u1 = first["usage"]
    assert u1["prompt_tokens"] > 1000
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0

    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    resp = await proxy.post("/v1/chat/completions", json=streamed)
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]  # every event but the last parses
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)
    u2 = chunks[-1]["usage"]  # include_usage: the last chunk carries the totals, no choices
    assert chunks[-1]["choices"] == []
    assert u2["prompt_tokens"] == u1["prompt_tokens"]
    assert u2["prompt_tokens_details"]["cached_tokens"] == full_block_hit(u2["prompt_tokens"])

    counters = await counters_after(proxy, "chat-1", 2)
    log.info("chat usage %s then %s; session counters %s", u1, u2, counters)
    assert counters["requests"] == 2
    assert counters["prompt_tokens"] == u1["prompt_tokens"] + u2["prompt_tokens"]
    assert counters["cached_tokens"] == u2["prompt_tokens_details"]["cached_tokens"]
    assert counters["completion_tokens"] == u1["completion_tokens"] + u2["completion_tokens"] == 8
    assert await metric(proxy, "kvkeeper_prompt_tokens_total") == counters["prompt_tokens"]
    assert await metric(proxy, "kvkeeper_cached_tokens_total") == counters["cached_tokens"]


def messages_body(tag: str, n_words: int) -> dict[str, Any]:
    """An Anthropic request whose long system block carries a cache_control breakpoint."""
    chat = chat_body(tag, n_words)
    system = chat["messages"][1]["content"]
    return {
        "model": "smol",
        "max_tokens": 4,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": f"Summarise, agent {tag}."}],
    }


def anthropic_total(usage: dict[str, Any]) -> int:
    """Anthropic semantics: input_tokens excludes the cache reads and the cache writes."""
    return int(
        usage["input_tokens"]
        + usage.get("cache_read_input_tokens", 0)
        + usage.get("cache_creation_input_tokens", 0)
    )


async def test_anthropic_messages_usage_semantics_and_session_counters(proxy: Client) -> None:
    body = messages_body("anthropic", 1000)
    headers = {"X-Session-Id": "msgs-1"}

    resp = await proxy.post("/v1/messages", json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    first = await resp.json()
    assert first["type"] == "message" and first["content"][0]["type"] == "text"
    u1 = first["usage"]
    total = anthropic_total(u1)
    # vLLM 0.32 follows Anthropic: a cold prompt reports its full blocks as cache writes
    assert u1["cache_read_input_tokens"] == 0
    assert u1["cache_creation_input_tokens"] == total // BLOCK * BLOCK
    assert u1["input_tokens"] == total - u1["cache_creation_input_tokens"]

    resp = await proxy.post("/v1/messages", json=body, headers=headers)
    u2 = (await resp.json())["usage"]
    assert anthropic_total(u2) == total
    assert u2["cache_read_input_tokens"] == full_block_hit(total)
    assert u2["cache_creation_input_tokens"] == 0
    assert u2["input_tokens"] == total - u2["cache_read_input_tokens"]

    resp = await proxy.post("/v1/messages", json={**body, "stream": True}, headers=headers)
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = [json.loads(e) for e in sse_events(await resp.text())]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    start_usage = events[0]["message"]["usage"]
    u3 = next(e["usage"] for e in events if e["type"] == "message_delta")
    # vLLM's message_start carries the TOTAL as input_tokens (no cache fields yet); the
    # message_delta at the end carries the Anthropic split. kvkeeper must take the latter.
    assert start_usage["input_tokens"] == total
    assert anthropic_total(u3) == total and u3["cache_read_input_tokens"] == full_block_hit(total)

    counters = await counters_after(proxy, "msgs-1", 3)
    log.info(
        "messages usage %s, %s, stream %s / %s; counters %s", u1, u2, start_usage, u3, counters
    )
    assert counters["prompt_tokens"] == 3 * total
    assert (
        counters["cached_tokens"] == u2["cache_read_input_tokens"] + u3["cache_read_input_tokens"]
    )
    assert (
        counters["completion_tokens"]
        == u1["output_tokens"] + u2["output_tokens"] + u3["output_tokens"]
    )
    session = await session_json(proxy, "msgs-1")
    assert session["ttl_s"] == 300  # the breakpoint's default "5m"


async def test_admission_priority_header_is_accepted_by_a_first_come_first_served_vllm(
    vllm_engine: VLLMEngine, redis_server: RedisServer, namespace: str
) -> None:
    """With ``admission_priority`` kvkeeper stamps X-Vllm-Priority on what it forwards. The
    suite's vLLM runs the default first-come-first-served policy, where 0.32 reads the header
    and ignores the value: a misconfigured kvkeeper must cost nothing there."""
    async with real_proxy(
        vllm_engine, redis_server.url, namespace, admission_priority=True
    ) as client:
        body = {**chat_body("priority", 900), "max_tokens": 2}
        body["agent_hint"] = {"session_id": "prio-1"}
        usages = []
        for _ in range(2):  # the second one's resident prefix lowers its priority value
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
            usages.append((await resp.json())["usage"])
        own = {**body, "priority": 0}  # a client's own priority is forwarded unchanged
        resp = await client.post("/v1/chat/completions", json=own)
        assert resp.status == 200, await resp.text()
    hit = full_block_hit(usages[1]["prompt_tokens"])
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == hit
