"""vLLM's side routes: tokenize, models, health, metrics, KV-event sources, cache reset."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from loadgen.sim.api import ENGINE, MODEL, TOKENIZER, _bad, _json_body, now
from loadgen.sim.routes_openai import anthropic_prompt, chat_prompt

REGISTRY = web.AppKey("registry", CollectorRegistry)
EVENT_SOURCES = web.AppKey("event_sources", dict[str, Any])


async def tokenize(request: web.Request) -> web.Response:
    """Completion form ``{prompt}`` or chat form ``{messages, add_generation_prompt, tools}``."""
    body = await _json_body(request)
    if "messages" in body:
        tokens = chat_prompt(body, request)
    elif isinstance(body.get("prompt"), str):
        tokens = request.app[TOKENIZER].encode(body["prompt"])
    else:
        raise _bad("give either prompt (a string) or messages")
    engine = request.app[ENGINE]
    return web.json_response(
        {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
    )


async def detokenize(request: web.Request) -> web.Response:
    body = await _json_body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise _bad("tokens must be a list of integers")
    return web.json_response({"prompt": request.app[TOKENIZER].decode(tokens)})


async def models(request: web.Request) -> web.Response:
    model = request.app[MODEL]
    card = {"id": model, "object": "model", "created": now(), "owned_by": "vllm", "root": model,
            "parent": None, "max_model_len": request.app[ENGINE].max_model_len}  # fmt: skip
    return web.json_response({"object": "list", "data": [card]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the one model's card, or vLLM's 404."""
    name = request.app[MODEL]
    if request.match_info["model"] != name:
        raise web.HTTPNotFound(text=f"The model `{request.match_info['model']}` does not exist.")
    card = {"id": name, "object": "model", "created": now(), "owned_by": "vllm", "root": name,
            "parent": None, "max_model_len": request.app[ENGINE].max_model_len}  # fmt: skip
    return web.json_response(card)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic ``/v1/messages/count_tokens``: the prompt's tokens, nothing computed."""
    body = await _json_body(request)
    return web.json_response({"input_tokens": len(anthropic_prompt(body, request))})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "sim"})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[REGISTRY])
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def kv_event_sources(request: web.Request) -> web.Response:
    return web.json_response(request.app[EVENT_SOURCES])


async def server_info(request: web.Request) -> web.Response:
    """vLLM's dev-mode ``GET /server_info?config_format=json``: the parts of its config kvkeeper
    reads (the scheduler's waiting-queue policy, the cache's block size)."""
    engine = request.app[ENGINE]
    config = {
        "scheduler_config": {"policy": engine.config.scheduling_policy},
        "cache_config": {"block_size": engine.config.block_size},
    }
    if request.query.get("config_format", "text") != "json":
        return web.json_response({"vllm_config": str(config), "vllm_env": {}})
    return web.json_response({"vllm_config": config, "vllm_env": {}})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Like vLLM (dev mode): HTTP 200 even when refused because requests hold blocks."""
    reset_running = request.query.get("reset_running_requests", "").lower() == "true"
    request.app[ENGINE].reset_prefix_cache(reset_running)
    return web.Response(status=200)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/server_info", server_info)
