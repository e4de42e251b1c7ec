"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/messages``, streaming and not."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from loadgen.sim.api import (
    MODEL,
    TOKENIZER,
    GenParams,
    _bad,
    _json_body,
    abort_unfinished,
    collect,
    new_id,
    now,
    open_sse,
    sse,
    submit,
    token_batches,
    usage,
)
from loadgen.sim.engine import SimRequest

# vLLM (>= 0.32, --fingerprint-mode full) stamps this on a stream's terminal chunks, or on its
# usage chunk when the client asked for usage
FINGERPRINT = "vllm-sim"


def completion_prompts(body: dict[str, Any], request: web.Request) -> list[list[int]]:
    """``prompt`` as text, token ids, or a batch of either."""
    prompt = body.get("prompt")
    tok = request.app[TOKENIZER]
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        out: list[list[int]] = []
        for item in prompt:
            if isinstance(item, str):
                out.append(tok.encode(item))
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                out.append(list(item))
            else:
                raise _bad("prompt must be a string, token ids, or a list of either")
        return out
    raise _bad("prompt must be a non-empty string or list of token ids")


def chat_prompt(body: dict[str, Any], request: web.Request) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    return request.app[TOKENIZER].apply_chat_template(
        messages,
        tools=body.get("tools"),
        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
    )


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    params = GenParams.parse(body, headers=request.headers)
    prompts = completion_prompts(body, request)
    if params.stream and len(prompts) > 1:
        raise _bad("streaming supports one prompt per request")
    reqs = [submit(request, p, params) for p in prompts]
    rid, model = new_id("cmpl"), request.app[MODEL]
    if params.stream:
        return await _stream_completion(request, reqs[0], params, rid, model)
    tok = request.app[TOKENIZER]
    choices, use = [], {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
    cached = 0
    for i, req in enumerate(reqs):
        ids = await collect(request, req)
        choices.append(
            {"index": i, "text": tok.decode(ids), "logprobs": None,
             "finish_reason": req.finish_reason, "stop_reason": None, "prompt_logprobs": None}
        )  # fmt: skip
        u = usage(req)
        for key in use:
            use[key] += u[key]
        cached += u["prompt_tokens_details"]["cached_tokens"]
    body_out = {"id": rid, "object": "text_completion", "created": now(), "model": model,
                "choices": choices, "usage": {**use, "prompt_tokens_details": {"cached_tokens": cached}}}  # fmt: skip
    return web.json_response(body_out)


async def _end_stream(
    resp: web.StreamResponse,
    params: GenParams,
    req: SimRequest,
    last: dict[str, Any],
    head: dict[str, Any],
) -> None:
    """The stream's last chunk, its usage chunk when asked (``head``: id, object, created,
    model), then ``[DONE]``."""
    if not params.include_usage:  # vLLM: the fingerprint ends the stream's last chunk
        last["system_fingerprint"] = FINGERPRINT
    await resp.write(sse(last))
    if params.include_usage:
        usage_chunk = {
            **head,
            "choices": [],
            "usage": usage(req),
            "system_fingerprint": FINGERPRINT,
        }
        await resp.write(sse(usage_chunk))
    await resp.write(sse("[DONE]"))


async def _stream_completion(
    request: web.Request, req: SimRequest, params: GenParams, rid: str, model: str
) -> web.StreamResponse:
    resp = await open_sse(request)
    try:
        tok, created = request.app[TOKENIZER], now()

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish, "stop_reason": None}]}  # fmt: skip

        async for batch in token_batches(req):
            await resp.write(sse(chunk(tok.decode(batch), None)))
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        await _end_stream(resp, params, req, chunk("", req.finish_reason), head)
    finally:
        abort_unfinished(request, req)
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    params = GenParams.parse(body, headers=request.headers)
    req = submit(request, chat_prompt(body, request), params)
    rid, model = new_id("chatcmpl"), request.app[MODEL]
    if params.stream:
        return await _stream_chat(request, req, params, rid, model)
    text = request.app[TOKENIZER].decode(await collect(request, req))
    return web.json_response(
        {"id": rid, "object": "chat.completion", "created": now(), "model": model,
         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": req.finish_reason, "stop_reason": None}],
         "usage": usage(req)}
    )  # fmt: skip


async def _stream_chat(
    request: web.Request, req: SimRequest, params: GenParams, rid: str, model: str
) -> web.StreamResponse:
    resp = await open_sse(request)
    try:
        tok, created = request.app[TOKENIZER], now()

        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]}  # fmt: skip

        await resp.write(sse(chunk({"role": "assistant", "content": ""}, None)))
        async for batch in token_batches(req):
            await resp.write(sse(chunk({"content": tok.decode(batch)}, None)))
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        await _end_stream(resp, params, req, chunk({}, req.finish_reason), head)
    finally:
        abort_unfinished(request, req)
    return resp


def anthropic_prompt(body: dict[str, Any], request: web.Request) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    system = body.get("system")
    full = ([{"role": "system", "content": system}] if system else []) + messages
    return request.app[TOKENIZER].apply_chat_template(full, tools=body.get("tools"))


def anthropic_usage(req: SimRequest) -> dict[str, int]:
    """Anthropic semantics: ``input_tokens`` excludes the tokens read from cache."""
    cached = max(req.num_cached_tokens, 0)
    return {
        "input_tokens": req.prompt_len - cached,
        "output_tokens": len(req.output_ids),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


async def messages(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    if not isinstance(body.get("max_tokens"), int):
        raise _bad("max_tokens is required")
    params = GenParams.parse(body, headers=request.headers)
    req = submit(request, anthropic_prompt(body, request), params)
    rid, model = f"msg_{new_id('sim')[4:]}", request.app[MODEL]
    if params.stream:
        return await _stream_messages(request, req, rid, model)
    text = request.app[TOKENIZER].decode(await collect(request, req))
    return web.json_response(
        {"id": rid, "type": "message", "role": "assistant", "model": model,
         "content": [{"type": "text", "text": text}],
         "stop_reason": _STOP.get(req.finish_reason or "stop", "end_turn"), "stop_sequence": None,
         "usage": anthropic_usage(req)}
    )  # fmt: skip


async def _stream_messages(
    request: web.Request, req: SimRequest, rid: str, model: str
) -> web.StreamResponse:
    resp = await open_sse(request)
    try:
        tok = request.app[TOKENIZER]
        started = False
        async for batch in token_batches(req):
            if not started:  # cached tokens are known once the request is scheduled
                started = True
                await resp.write(
                    sse({"type": "message_start",
                         "message": {"id": rid, "type": "message", "role": "assistant",
                                     "model": model, "content": [], "stop_reason": None,
                                     "stop_sequence": None, "usage": anthropic_usage(req)}},
                        "message_start")
                )  # fmt: skip
                await resp.write(
                    sse({"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}, "content_block_start")
                )  # fmt: skip
            await resp.write(
                sse({"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": tok.decode(batch)}},
                    "content_block_delta")
            )  # fmt: skip
        await resp.write(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        await resp.write(
            sse({"type": "message_delta",
                 "delta": {"stop_reason": _STOP.get(req.finish_reason or "stop", "end_turn"),
                           "stop_sequence": None},
                 "usage": anthropic_usage(req)}, "message_delta")
        )  # fmt: skip
        await resp.write(sse({"type": "message_stop"}, "message_stop"))
    finally:
        abort_unfinished(request, req)
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/messages", messages)
