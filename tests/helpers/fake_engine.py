"""A small, real OpenAI-compatible HTTP server for the proxy's tests (not the simulator).

It serves /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses (JSON and SSE),
/v1/models and /health; models a prefix cache by remembering prompts (cached_tokens = longest
common prefix in 'tokens' = characters / 4); records every request it receives; can be told to
delay, and notes when a client went away mid-response.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict


@dataclass
class Received:
    path: str
    headers: CIMultiDict[str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeEngine:
    name: str = "fake"
    model: str = "fake-model"
    delay_s: float = 0.0  # before the first byte
    chunk_delay_s: float = 0.0  # between stream chunks
    n_chunks: int = 3
    # streams: after this many chunks the engine "dies" (drops the connection) or "stalls"
    fail_after_chunks: int | None = None
    fail_mode: str = "die"
    hung: bool = False  # accepts connections, never answers (health included)
    received: list[Received] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0
    prompts: list[str] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None

    def _cached(self, prompt: str) -> tuple[int, int]:
        best = 0
        for seen in self.prompts:
            n = 0
            for a, b in zip(seen, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self.prompts.append(prompt)
        return max(1, len(prompt) // 4), best // 4

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
            app.router.add_post(path, self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.hung:
            await asyncio.sleep(3600)
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": self.name}],
            }
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append(Received(request.path, CIMultiDict(request.headers), raw))
        if self.hung:
            await asyncio.sleep(3600)
        body = json.loads(raw)
        if body.get("model") == "error":
            return web.json_response(
                {
                    "error": {
                        "message": "bad model",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": None,
                    }
                },
                status=400,
            )
        prompt = json.dumps(body.get("messages") or body.get("prompt") or body.get("input"))
        prompt_tokens, cached = self._cached(prompt)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if body.get("stream"):
                return await self._stream(request, body, prompt_tokens, cached)
            return web.json_response(self._final(request.path, body, prompt_tokens, cached))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def _usage(self, path: str, prompt: int, cached: int) -> dict[str, Any]:
        if path == "/v1/messages":
            return {
                "input_tokens": prompt - cached,
                "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0,
                "output_tokens": self.n_chunks,
            }
        if path == "/v1/responses":
            return {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": self.n_chunks,
                "total_tokens": prompt + self.n_chunks,
            }
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.n_chunks,
            "total_tokens": prompt + self.n_chunks,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _final(self, path: str, body: dict[str, Any], prompt: int, cached: int) -> dict[str, Any]:
        self.completed += 1
        text = " ".join(f"tok{i}" for i in range(self.n_chunks))
        usage = self._usage(path, prompt, cached)
        if path == "/v1/messages":
            return {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "usage": usage,
            }
        if path == "/v1/responses":
            return {
                "id": "resp_1",
                "object": "response",
                "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
                "usage": usage,
            }
        return {
            "id": "cmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "engine": self.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: int, cached: int
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        path = request.path
        usage = self._usage(path, prompt, cached)
        event: dict[str, Any]
        for i in range(self.n_chunks):
            if path == "/v1/messages":
                event = {
                    "type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": f"tok{i} "},
                }
                if i == 0:
                    await resp.write(
                        b"event: message_start\ndata: "
                        + json.dumps(
                            {
                                "type": "message_start",
                                "message": {
                                    "usage": {
                                        k: v for k, v in usage.items() if k != "output_tokens"
                                    }
                                },
                            }
                        ).encode()
                        + b"\n\n"
                    )
            else:
                event = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": f"tok{i} "}}],
                    "engine": self.name,
                }
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if self.fail_after_chunks is not None and i + 1 >= self.fail_after_chunks:
                if self.fail_mode == "stall":
                    await asyncio.sleep(3600)
                await asyncio.sleep(0.1)  # the chunks written so far reach the proxy
                assert request.transport is not None
                request.transport.abort()
                return resp
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        if path == "/v1/messages":
            await resp.write(
                b"event: message_delta\ndata: "
                + json.dumps(
                    {"type": "message_delta", "usage": {"output_tokens": self.n_chunks}}
                ).encode()
                + b"\n\n"
            )
        elif path == "/v1/responses":
            await resp.write(
                b"data: "
                + json.dumps({"type": "response.completed", "response": {"usage": usage}}).encode()
                + b"\n\n"
            )
        elif (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(
                b"data: "
                + json.dumps({"id": "c1", "choices": [], "usage": usage}).encode()
                + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.completed += 1
        return resp


@asynccontextmanager
async def serve_fake(engine: FakeEngine) -> AsyncIterator[FakeEngine]:
    """Run the fake engine on 127.0.0.1 with an ephemeral port."""
    runner = web.AppRunner(engine.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engine.url = f"http://127.0.0.1:{port}"
    engine.runner = runner
    try:
        yield engine
    finally:
        await runner.cleanup()
