"""HTTP handlers in vLLM's OpenAI (and Anthropic) shapes, over :class:`SimEngine`.

Handlers only parse, call the engine and shape the answer; one middleware turns every error into
vLLM's ``{"error": {"message", "type", "param", "code"}}`` body.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from adapters.vllm import PRIORITY_HEADER  # vLLM 0.32: overrides the body's ``priority``
from loadgen.sim.engine import EngineRejected, Finished, SimEngine, SimRequest
from loadgen.sim.tokenizer import SimTokenizer

ENGINE = web.AppKey("engine", SimEngine)
TOKENIZER = web.AppKey("tokenizer", SimTokenizer)
MODEL = web.AppKey("model", str)
REPLY = web.AppKey("reply", list[int])
# simulator-only usage fields (see :func:`usage`)
SIM_ENGINE_TTFT = "sim_engine_ttft_s"
SIM_SPEED = "sim_speed"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.text or exc.reason)
    except (EngineRejected, ValueError, TypeError, KeyError) as exc:
        return error_response(400, str(exc))


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=message)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        raise _bad(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    _check_model(request, body)
    return body


def _check_model(request: web.Request, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != request.app[MODEL]:
        raise web.HTTPNotFound(text=f"The model `{model}` does not exist.")


@dataclass(frozen=True, slots=True)
class GenParams:
    """Sampling fields the simulator honours."""

    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    cache_salt: str | None
    stream: bool
    include_usage: bool
    priority: int = 0

    @classmethod
    def parse(
        cls,
        body: dict[str, Any],
        *,
        max_key: str = "max_tokens",
        headers: Mapping[str, str] | None = None,
    ) -> GenParams:
        max_tokens = body.get(max_key, body.get("max_completion_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise _bad(f"{max_key} must be a positive integer")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise _bad("cache_salt must be a non-empty string")
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise _bad("priority must be an integer")
        header = (headers or {}).get(PRIORITY_HEADER)
        if header is not None:  # vLLM: the header wins over the body field; junk is ignored
            with contextlib.suppress(ValueError):
                priority = int(header)
        opts = body.get("stream_options") or {}
        return cls(
            max_tokens=max_tokens,
            min_tokens=int(body.get("min_tokens") or 0),
            ignore_eos=bool(body.get("ignore_eos", False)),
            cache_salt=salt,
            stream=bool(body.get("stream", False)),
            include_usage=bool(opts.get("include_usage", False)),
            priority=priority,
        )


def submit(request: web.Request, prompt: list[int], params: GenParams) -> SimRequest:
    engine = request.app[ENGINE]
    return engine.add_request(
        prompt,
        max_tokens=params.max_tokens,
        cache_salt=params.cache_salt,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        reply=request.app[REPLY],
        priority=params.priority,
    )


async def token_batches(req: SimRequest) -> AsyncIterator[list[int]]:
    """The request's sampled tokens until it finishes, in batches: every token produced since
    the last batch was taken. A stream that keeps up gets one token per chunk; one that falls
    behind the engine gets them together, as vLLM's output processor sends a delta of all
    new tokens (and the simulator does not spend a write per token when it is busiest)."""
    while True:
        batch: list[int] = []
        item = await req.outputs.get()
        while not isinstance(item, Finished):
            batch.append(item)
            if req.outputs.empty():
                break
            item = req.outputs.get_nowait()
        if batch:
            yield batch
        if isinstance(item, Finished):
            return


def abort_unfinished(request: web.Request, req: SimRequest) -> None:
    """Called when a handler leaves (client gone, write failed): frees the request's blocks."""
    if req.finish_reason is None:
        request.app[ENGINE].abort(req)


async def collect(request: web.Request, req: SimRequest) -> list[int]:
    try:
        return [tok async for batch in token_batches(req) for tok in batch]
    finally:
        abort_unfinished(request, req)


def usage(req: SimRequest) -> dict[str, Any]:
    """vLLM's usage block, plus two simulator-only fields (no real engine sends them):
    ``sim_engine_ttft_s``, the wall seconds from the request's arrival in the engine to its
    first token (queueing and prefill; parsing the body and streaming the chunk are outside),
    and ``sim_speed``, how many times faster than its profile the engine ran. A benchmark
    scales the engine's part back to the profile's speed with them (``loadgen.metrics``)."""
    prompt, completion = req.prompt_len, len(req.output_ids)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)},
    }
    if req.first_token_at is not None:
        out[SIM_ENGINE_TTFT] = round(req.first_token_at - req.arrival, 6)
        out[SIM_SPEED] = req.speed
    return out


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    return resp


# the first 8 hex digits of every response id this simulator process gives: a benchmark behind a
# router (vllm-router relays bodies unchanged) can tell from the id which replica served a call
INSTANCE = uuid.uuid4().hex[:8]


def new_id(prefix: str) -> str:
    return f"{prefix}-{INSTANCE}{uuid.uuid4().hex[8:]}"


def now() -> int:
    return int(time.time())
