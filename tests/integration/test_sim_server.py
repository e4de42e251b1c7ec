"""The simulator over real HTTP: OpenAI/Anthropic shapes, cached tokens, pressure, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from adapters.prom import cache_config_from, parse_text, total
from adapters.vllm import event_endpoints_from
from loadgen.sim import SimConfig, Simulator, run_simulator

MODEL = "sim"


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    async with run_simulator(SimConfig(num_blocks=64, profile="instant", model=MODEL)) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    text = await resp.text()
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def test_completion_cached_tokens_rise_on_repeat(sim: Simulator, http: aiohttp.ClientSession) -> None:  # fmt: skip
    prompt = list(range(5000, 5000 + 200))  # 6 full blocks + 8
    first = await post(http, f"{sim.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})  # fmt: skip
    second = await post(http, f"{sim.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})  # fmt: skip
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert second["usage"]["completion_tokens"] == 4
    assert second["choices"][0]["finish_reason"] == "length"
    assert second["choices"][0]["text"] == first["choices"][0]["text"] != ""


async def test_chat_stream_with_usage_and_tokenize_agree(sim: Simulator, http: aiohttp.ClientSession) -> None:  # fmt: skip
    messages = [{"role": "system", "content": "You are terse. " * 30},
                {"role": "user", "content": "What is a KV cache?"}]  # fmt: skip
    tok = await post(http, f"{sim.url}/tokenize", {"model": MODEL, "messages": messages})
    assert tok["count"] == len(tok["tokens"]) > 64
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 5,
            "stream_options": {"include_usage": True}}  # fmt: skip
    for attempt in range(2):
        async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text.startswith(" This is")
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        use = chunks[-1]["usage"]
        assert use["prompt_tokens"] == tok["count"]
        assert use["completion_tokens"] == 5
        expected = 0 if attempt == 0 else (tok["count"] - 1) // 32 * 32
        assert use["prompt_tokens_details"]["cached_tokens"] == expected


async def test_completion_stream_without_usage(sim: Simulator, http: aiohttp.ClientSession) -> None:  # fmt: skip
    body = {"prompt": "hello there, simulator", "stream": True, "max_tokens": 3}
    async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
        events = await sse_events(resp)
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4  # 3 tokens + the finish chunk
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_anthropic_messages_usage(sim: Simulator, http: aiohttp.ClientSession) -> None:
    system = [{"type": "text", "text": "Rules. " * 60, "cache_control": {"type": "ephemeral"}}]
    body = {"model": MODEL, "max_tokens": 4, "system": system,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}  # fmt: skip
    first = await post(http, f"{sim.url}/v1/messages", body)
    second = await post(http, f"{sim.url}/v1/messages", body)
    assert first["type"] == "message"
    assert first["stop_reason"] == "max_tokens"
    u1, u2 = first["usage"], second["usage"]
    assert u1["cache_read_input_tokens"] == 0
    prompt = u1["input_tokens"]
    assert u2["cache_read_input_tokens"] == (prompt - 1) // 32 * 32
    assert u2["input_tokens"] + u2["cache_read_input_tokens"] == prompt
    body["stream"] = True
    async with http.post(f"{sim.url}/v1/messages", json=body) as resp:
        text = await resp.text()
    kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert kinds.count("content_block_delta") == 4


async def test_cache_salt_isolates(sim: Simulator, http: aiohttp.ClientSession) -> None:
    prompt = list(range(100, 300))
    url = f"{sim.url}/v1/completions"
    await post(http, url, {"prompt": prompt, "max_tokens": 1, "cache_salt": "a"})
    other = await post(http, url, {"prompt": prompt, "max_tokens": 1, "cache_salt": "b"})
    same = await post(http, url, {"prompt": prompt, "max_tokens": 1, "cache_salt": "a"})
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 192


async def test_eviction_under_pressure_and_metrics(sim: Simulator, http: aiohttp.ClientSession) -> None:  # fmt: skip
    url = f"{sim.url}/v1/completions"
    victim = list(range(0, 640))  # 20 blocks of a 63-block pool
    await post(http, url, {"prompt": victim, "max_tokens": 1})
    for i in range(1, 4):  # 3 x 20 blocks of other prompts push the victim out
        await post(
            http, url, {"prompt": list(range(i * 10_000, i * 10_000 + 640)), "max_tokens": 1}
        )
    again = await post(http, url, {"prompt": victim, "max_tokens": 1})
    # the third flood took the 3 never-used blocks, then 17 of the victim's 20 from its TAIL
    # (freed in reverse): its first 3 blocks survive
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    async with http.get(f"{sim.url}/metrics") as resp:
        samples = parse_text(await resp.text())
    assert total(samples, "vllm:prefix_cache_queries") == 5 * 640
    assert total(samples, "vllm:prefix_cache_hits") == 96
    assert total(samples, "vllm:prompt_tokens") == 5 * 640
    assert total(samples, "vllm:num_requests_running") == 0
    assert total(samples, "vllm:time_to_first_token_seconds_count") == 5
    config = cache_config_from(samples)
    assert config is not None
    assert (config.block_size, config.num_blocks, config.hash_algo) == (32, 64, "sha256_cbor")


async def test_side_routes(sim: Simulator, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{sim.url}/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == MODEL
    async with http.get(f"{sim.url}/kv_event_sources") as resp:
        found = event_endpoints_from(await resp.json(), "127.0.0.1")
    assert found is not None
    assert (found.endpoint, found.replay_endpoint) == (sim.events_endpoint, sim.replay_endpoint)
    ids = await post(http, f"{sim.url}/tokenize", {"prompt": "round trip ✓"})
    text = await post(http, f"{sim.url}/detokenize", {"tokens": ids["tokens"]})
    assert text["prompt"] == "round trip ✓"


async def test_errors_use_the_openai_shape(sim: Simulator, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{sim.url}/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == 404
    async with http.post(f"{sim.url}/v1/completions", json={"prompt": list(range(3000))}) as r:
        assert r.status == 400  # longer than the 63-block pool can ever hold
        assert "maximum context" in (await r.json())["error"]["message"]
    async with http.post(f"{sim.url}/v1/chat/completions", data=b"{not json") as r:
        assert r.status == 400


async def test_client_disconnect_frees_the_request(sim: Simulator, http: aiohttp.ClientSession) -> None:  # fmt: skip
    body = {"prompt": list(range(64)), "stream": True, "max_tokens": 100_000, "ignore_eos": True}
    async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
        await resp.content.readline()  # first token arrived: the request is running
        assert sim.engine.running
    for _ in range(200):  # the server notices on its next write
        if not sim.engine.busy:
            break
        await asyncio.sleep(0.01)
    assert not sim.engine.busy
    assert sim.engine.pool.num_free == 63


async def test_reset_prefix_cache(sim: Simulator, http: aiohttp.ClientSession) -> None:
    prompt = list(range(300))
    await post(http, f"{sim.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
    async with http.post(f"{sim.url}/reset_prefix_cache") as resp:
        assert resp.status == 200
    again = await post(http, f"{sim.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_the_adapter_reads_the_engines_scheduling_policy(policy: str) -> None:
    """kvkeeper reads the waiting-queue order from vLLM's dev-mode /server_info (the simulator
    serves the same shape) before it stamps admission priorities."""
    from adapters.vllm import VLLMAdapter

    config = SimConfig(num_blocks=64, profile="instant", model=MODEL, scheduling_policy=policy)  # type: ignore[arg-type]
    async with run_simulator(config) as s, aiohttp.ClientSession() as http:
        adapter = VLLMAdapter("sim", s.url, http, model=MODEL)
        assert adapter.scheduling_policy is None
        assert await adapter.discover_scheduling_policy() == policy
        assert adapter.scheduling_policy == policy
        async with http.get(f"{s.url}/server_info") as resp:  # text form, as vLLM's default
            assert policy in (await resp.json())["vllm_config"]


async def test_an_engine_without_server_info_leaves_the_policy_unknown(http: aiohttp.ClientSession) -> None:  # fmt: skip
    from aiohttp import web

    from adapters.vllm import VLLMAdapter

    app = web.Application()  # an engine without the dev-mode route: 404
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        adapter = VLLMAdapter("bare", f"http://127.0.0.1:{port}", http, model=MODEL)
        assert await adapter.discover_scheduling_policy() is None
    finally:
        await runner.cleanup()
