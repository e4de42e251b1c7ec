"""``/v1/responses`` (the OpenAI Responses API as vLLM serves it), streamed and not, with stored
responses: ``GET /v1/responses/{id}`` and ``previous_response_id`` (the earlier turns are
prepended to the prompt, so a continued conversation shares its prefix with the last one)."""

from __future__ import annotations

from collections import OrderedDict
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
)
from loadgen.sim.engine import SimRequest

_MAX_STORED = 10_000  # stored responses kept (oldest dropped first)


class Stored:
    """A stored response: its JSON body and the conversation it ends (input + output)."""

    __slots__ = ("body", "messages")

    def __init__(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.body, self.messages = body, messages


STORE = web.AppKey("responses", OrderedDict[str, Stored])


def _input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user turn; a list holds messages (``role`` +
    ``content`` string or ``input_text``/``output_text`` parts) or bare text parts."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("input must be a non-empty string or list")
    out: list[dict[str, Any]] = []
    for item in raw:
        if not isinstance(item, dict):
            raise _bad("input items must be objects")
        content = item.get("content", item.get("text", ""))
        if isinstance(content, list):
            content = "".join(
                str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content
            )
        out.append({"role": str(item.get("role", "user")), "content": str(content)})
    return out


def _conversation(request: web.Request, body: dict[str, Any]) -> list[dict[str, Any]]:
    previous = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if previous is not None:
        stored = request.app[STORE].get(str(previous))
        if stored is None:
            raise web.HTTPNotFound(text=f"Response with id '{previous}' not found.")
        history = list(stored.messages)
    instructions = body.get("instructions")
    system = [{"role": "system", "content": str(instructions)}] if instructions else []
    return system + history + _input_messages(body)


def _usage(req: SimRequest) -> dict[str, Any]:
    prompt, output = req.prompt_len, len(req.output_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _message(mid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def _response(
    rid: str, body: dict[str, Any], model: str, created: int, status: str,
    output: list[dict[str, Any]], usage: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    return {"id": rid, "object": "response", "created_at": created, "model": model,
            "status": status, "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"), "output": output,
            "store": bool(body.get("store", True)), "usage": usage}  # fmt: skip


async def create(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    params = GenParams.parse(body, max_key="max_output_tokens", headers=request.headers)
    messages = _conversation(request, body)
    req = submit(request, request.app[TOKENIZER].apply_chat_template(messages), params)
    rid, mid, model, created = new_id("resp"), new_id("msg"), request.app[MODEL], now()
    if params.stream:
        return await _stream(request, body, req, rid, mid, model, created, messages)
    text = request.app[TOKENIZER].decode(await collect(request, req))
    out = _response(rid, body, model, created, "completed", [_message(mid, text, "completed")],
                    _usage(req))  # fmt: skip
    _remember(request, body, out, messages, text)
    return web.json_response(out)


def _remember(
    request: web.Request,
    body: dict[str, Any],
    out: dict[str, Any],
    messages: list[dict[str, Any]],
    text: str,
) -> None:
    if not body.get("store", True):
        return
    store = request.app[STORE]
    conversation = [m for m in messages if m["role"] != "system"]
    store[out["id"]] = Stored(out, [*conversation, {"role": "assistant", "content": text}])
    while len(store) > _MAX_STORED:
        store.popitem(last=False)


async def _stream(
    request: web.Request,
    body: dict[str, Any],
    req: SimRequest,
    rid: str,
    mid: str,
    model: str,
    created: int,
    messages: list[dict[str, Any]],
) -> web.StreamResponse:
    resp = await open_sse(request)
    seq = 0

    async def event(kind: str, data: dict[str, Any]) -> None:
        nonlocal seq
        await resp.write(sse({"type": kind, "sequence_number": seq, **data}, kind))
        seq += 1

    try:
        tok = request.app[TOKENIZER]
        start = _response(rid, body, model, created, "in_progress", [], None)
        await event("response.created", {"response": start})
        await event("response.in_progress", {"response": start})
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        await event("response.output_item.added",
                    {"output_index": 0, "item": _message(mid, "", "in_progress") | {"content": []}})  # fmt: skip
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        await event("response.content_part.added", {**where, "part": part})
        text = ""
        async for batch in token_batches(req):
            delta = tok.decode(batch)
            text += delta
            await event("response.output_text.delta", {**where, "delta": delta})
        await event("response.output_text.done", {**where, "text": text})
        await event("response.content_part.done", {**where, "part": {**part, "text": text}})
        item = _message(mid, text, "completed")
        await event("response.output_item.done", {"output_index": 0, "item": item})
        final = _response(rid, body, model, created, "completed", [item], _usage(req))
        await event("response.completed", {"response": final})
        _remember(request, body, final, messages, text)
    finally:
        abort_unfinished(request, req)
    return resp


async def retrieve(request: web.Request) -> web.Response:
    stored = request.app[STORE].get(request.match_info["response_id"])
    if stored is None:
        raise web.HTTPNotFound(text=f"Response with id '{request.match_info['response_id']}' not found.")  # fmt: skip
    return web.json_response(stored.body)


def add_routes(app: web.Application) -> None:
    app[STORE] = OrderedDict()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
