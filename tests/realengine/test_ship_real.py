"""Issue 26 against the real vLLM: a stream that did not ask for usage reaches the client exactly
as vLLM sends it (system_fingerprint included) while its session counts the usage; the side
routes (count_tokens, tokenize, version, a model card) pass through byte for byte; a stored
Responses answer is found again through kvkeeper; the block-hash self-check passes."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest

from tests.helpers.redis_server import RedisServer
from tests.realengine.conftest import VLLMEngine
from tests.realengine.test_proxy_real import ADMIN, counters_after, real_proxy, wait_for

pytestmark = pytest.mark.realengine

_VARYING = re.compile(rb'"(id|created|created_at)":("[^"]*"|\d+)')


def _normal(body: bytes) -> bytes:
    """A stream with the per-request values (ids, timestamps) blanked."""
    return _VARYING.sub(rb'"\1":0', body)


async def _direct(method: str, url: str, body: Any = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.request(method, url, json=body) as r:
        return r.status, await r.read()


async def test_stream_without_usage_is_vllms_own_bytes_and_counted(
    vllm_engine: VLLMEngine, redis_server: RedisServer, namespace: str
) -> None:
    async with real_proxy(vllm_engine, redis_server.url, namespace) as proxy:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}]}),
            ("/v1/completions", {"prompt": "The capital of France is"}),
        ):
            body = {**body, "model": vllm_engine.model, "max_tokens": 4, "temperature": 0,
                    "stream": True}  # fmt: skip
            _, direct = await _direct("POST", vllm_engine.url + path, body)
            assert b'"usage"' not in direct and b'"system_fingerprint"' in direct
            sid = f"s{len(path)}"
            resp = await proxy.post(path, json=body, headers={"X-Session-Id": sid})
            proxied = await resp.read()
            assert resp.status == 200
            assert _normal(proxied) == _normal(direct), (proxied, direct)
            counters = await counters_after(proxy, sid, 1)
            assert counters["prompt_tokens"] > 0 and counters["completion_tokens"] == 4


async def test_side_routes_responses_and_hash_check(
    vllm_engine: VLLMEngine, redis_server: RedisServer, namespace: str
) -> None:
    model = vllm_engine.model
    async with real_proxy(vllm_engine, redis_server.url, namespace) as proxy:
        msg = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        for method, path, body in (
            ("POST", "/tokenize", {"model": model, "prompt": "hello there"}),
            ("POST", "/detokenize", {"model": model, "tokens": [1, 2, 3]}),
            ("POST", "/v1/messages/count_tokens", msg),
            ("GET", "/version", None),
            ("GET", "/health", None),
            ("GET", f"/v1/models/{model}", None),
            ("GET", "/v1/responses/resp_unknown", None),
        ):
            status, direct = await _direct(method, vllm_engine.url + path, body)
            resp = await proxy.request(method, path, json=body)
            got = await resp.read()
            assert resp.status == status, (path, got)
            assert _normal(got) == _normal(direct), path
        created = await proxy.post(
            "/v1/responses", json={"model": model, "input": "Say hi.", "max_output_tokens": 8}
        )
        assert created.status == 200, await created.text()
        rid = (await created.json())["id"]
        # stored only where the engine keeps responses (VLLM_ENABLE_RESPONSES_API_STORE=1):
        # through kvkeeper the answer is the engine's own either way
        status, direct = await _direct("GET", f"{vllm_engine.url}/v1/responses/{rid}")
        again = await proxy.get(f"/v1/responses/{rid}")
        assert again.status == status and _normal(await again.read()) == _normal(direct)

        async def decided() -> bool:
            engines = await (await proxy.get("/admin/engines", headers=ADMIN)).json()
            return bool(engines["data"][0]["hash_check"]["status"] != "pending")

        assert await wait_for(decided)
        engines = await (await proxy.get("/admin/engines", headers=ADMIN)).json()
        assert engines["data"][0]["hash_check"]["status"] == "ok", engines["data"][0]
        assert json.dumps(engines).count('"mode": "events"') == 1
