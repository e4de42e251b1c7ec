"""The simulator's Responses API (/v1/responses, stored responses, previous_response_id) and
its other vLLM side routes (model card, count_tokens, version)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from loadgen.sim import SimConfig, Simulator, run_simulator


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    async with run_simulator(SimConfig(num_blocks=64, profile="instant", model="sim")) as s:
        yield s


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_responses_json_stored_and_continued(sim: Simulator) -> None:
    long_input = "tell me about caches " * 30
    async with aiohttp.ClientSession() as http:
        async with http.post(
            sim.url + "/v1/responses", json={"model": "sim", "input": long_input}
        ) as r:
            assert r.status == 200
            first = await r.json()
        assert first["object"] == "response" and first["status"] == "completed"
        assert first["output"][0]["content"][0]["text"]
        assert first["usage"]["input_tokens"] > 64
        async with http.get(f"{sim.url}/v1/responses/{first['id']}") as r:
            assert r.status == 200 and await r.json() == first
        body = {"model": "sim", "input": "and more", "previous_response_id": first["id"]}
        async with http.post(sim.url + "/v1/responses", json=body) as r:
            second = await r.json()
        assert second["previous_response_id"] == first["id"]
        # the earlier turn is the new prompt's prefix: its full blocks come from the cache
        assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 64
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
        body["previous_response_id"] = "resp-unknown"
        async with http.post(sim.url + "/v1/responses", json=body) as r:
            assert r.status == 404 and "not found" in (await r.json())["error"]["message"]
        async with http.get(sim.url + "/v1/responses/resp-unknown") as r:
            assert r.status == 404


async def test_responses_stream_events_end_with_usage(sim: Simulator) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            sim.url + "/v1/responses", json={"model": "sim", "input": "hi", "stream": True}
        ) as r,
    ):
        assert r.headers["Content-Type"].startswith("text/event-stream")
        evs = events(await r.text())
    kinds = [k for k, _ in evs]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    rid = evs[0][1]["response"]["id"]
    final = evs[-1][1]["response"]
    assert final["id"] == rid and final["usage"]["output_tokens"] > 0
    text = "".join(d["delta"] for k, d in evs if k == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text
    async with aiohttp.ClientSession() as http, http.get(f"{sim.url}/v1/responses/{rid}") as r:
        assert (await r.json())["output"][0]["content"][0]["text"] == text


async def test_side_routes_model_card_count_tokens_version(sim: Simulator) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(sim.url + "/v1/models/sim") as r:
            assert r.status == 200 and (await r.json())["id"] == "sim"
        async with http.get(sim.url + "/v1/models/other") as r:
            assert r.status == 404
        msg = {"model": "sim", "messages": [{"role": "user", "content": "count me"}]}
        async with http.post(sim.url + "/v1/messages/count_tokens", json=msg) as r:
            assert (await r.json())["input_tokens"] > 2
        async with http.get(sim.url + "/version") as r:
            assert (await r.json())["version"] == "sim"
