"""The data plane: OpenAI / Anthropic routes proxied byte for byte, plus health and metrics."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.access import access_info
from proxy.admin_models import EditOutcome, Health, ManagementResult, Readiness
from proxy.edits import outcome_header
from proxy.errors import NotFound, StoreUnavailable
from proxy.forward import HINT_HEADER, Forwarded, Outbound, forward
from proxy.hint_model import Hint
from proxy.hints import parse_request
from proxy.keys import SessionKey
from proxy.passthrough import previous_response_id, remember_response, response_engine
from proxy.relay import engine_visible
from proxy.runtime import RUNTIME, Registration, Runtime
from proxy.store import StoreDown, Upserted, Usage

log = logging.getLogger("kvkeeper.routes")

_NO_USAGE = Usage()  # an answer that told none
PROXIED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


async def proxy_request(request: web.Request) -> web.StreamResponse:
    """Parse hints, register the session, forward to an engine, stream the answer back."""
    rt = request.app[RUNTIME]
    tenant = rt.tenants.tenant_for(request.headers)
    access_info(request).tenant = tenant
    raw = await request.read()
    parsed = parse_request(request.path, request.headers, raw, rt.settings.limits)
    hint = parsed.hint
    # a known repeat's registration at once, else the task doing it
    registering: Registration | asyncio.Task[Registration] | None = None
    if hint is not None:
        for dialect in hint.dialects:
            rt.metrics.child(rt.metrics.hints, dialect).inc()
        if hint.manage_request:
            access_info(request).hint = "manage_request"
            return await _manage(rt, tenant, hint)
        registering = rt.register_repeat(tenant, hint)
        if registering is None:  # the Redis round trip runs while the request travels on
            registering = asyncio.create_task(rt.register(tenant, hint))
    # a Responses request continuing a stored response runs where that response is stored
    previous = previous_response_id(request.path, parsed.json_body, raw)
    out = Outbound(
        request,
        parsed.body,
        raw,
        parsed.json_body,
        SessionKey(tenant, hint.session_id) if hint is not None else None,
        edits=bool(hint and hint.edits),
        pinned=await response_engine(request, tenant, previous) if previous else None,
    )
    failed = True
    try:
        done = await forward(rt, out, registering)
        failed = not done.ok
    finally:
        if isinstance(registering, asyncio.Task) and not registering.done():
            rt.keep(registering)  # forwarding failed first: let the registration finish
        if registering is not None and hint is not None and failed:
            rt.spawn(rt.unregister_failed(tenant, hint, registering))
    response_id = access_info(request).response_id
    if response_id is not None and done.ok:
        remember_response(request, tenant, response_id, done.engine.name)
    reg = done.registration
    key, up = out.key, reg.upserted if reg is not None else None
    if key is not None and hint is not None and up is not None and done.ok:
        _after(rt, key, hint, up, request.path, parsed.body, done)
    return done.response


def _after(
    rt: Runtime,
    key: SessionKey,
    hint: Hint,
    before: Upserted,
    route: str,
    body: bytes,
    done: Forwarded,
) -> None:
    """Record usage + context (buffered, written in batches), feed retention, run edits."""
    assert rt.completions is not None
    tenant, engine, usage = key.tenant, done.engine, done.usage
    rt.completions.add(
        tenant,
        hint.session_id,
        engine=engine.name,
        usage=usage or _NO_USAGE,
        route=route,
        body=body,
        breakpoint=hint.breakpoint,
        block_offset=hint.block_offset,
        now=time.time(),
    )
    if rt.retention is not None:
        rt.retention.on_completion(engine.name, usage, before, key)
    if hint.edits:
        rt.spawn(_apply_edits(rt, tenant, hint))
    if hint.retain_s and rt.longterm is not None:
        rt.spawn(_retain_long(rt, tenant, hint.session_id, engine.name, hint.retain_s))


async def _retain_long(rt: Runtime, tenant: str, sid: str, engine: str, retain_s: float) -> None:
    """Retention beyond the GPU cap: pin the context in the offload tier once it is recorded."""
    assert rt.longterm is not None
    await rt.settle()
    await rt.longterm.retain(tenant, sid, engine, retain_s)


async def _apply_edits(rt: Runtime, tenant: str, hint: Hint) -> None:
    """Deferred edits of a served request run once its context is written."""
    await rt.settle()
    results = await rt.edits.apply(tenant, hint.session_id, hint.edits)
    for r in results:
        rt.metrics.edits.labels(r.edit.type, r.status).inc()


async def _manage(rt: Runtime, tenant: str, hint: Hint) -> web.Response:
    """``manage_request: true``: run the edits now, never reach the model."""
    if rt.store is None:
        raise StoreUnavailable("session store unavailable", code="store_unavailable")
    await rt.settle()
    try:
        session = await rt.store.get(tenant, hint.session_id)
    except StoreDown as exc:
        raise StoreUnavailable("session store unavailable", code="store_unavailable") from exc
    if session is None:
        raise NotFound(
            f"no session {hint.session_id!r}", param="agent_hint.session_id", code="unknown_session"
        )
    results = await rt.edits.apply(tenant, hint.session_id, hint.edits)
    for r in results:
        rt.metrics.edits.labels(r.edit.type, r.status).inc()
    body = ManagementResult(
        session_id=hint.session_id, results=[EditOutcome(**r.to_json()) for r in results]
    )
    headers = {HINT_HEADER: "accepted", "X-KVKeeper-Edits": outcome_header(results)}
    return web.json_response(text=body.model_dump_json(exclude_none=True), headers=headers)


async def models(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    rt.tenants.tenant_for(request.headers)
    return web.json_response({"object": "list", "data": await rt.pool.models()})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response(text=Health().model_dump_json())


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 when at least one engine passed its last health check, else 503. Redis is
    reported but does not gate readiness: without it requests still flow, hints answer
    ``rejected; reason=store_unavailable`` (``kvkeeper_redis_up`` 0)."""
    rt = request.app[RUNTIME]
    engines = {e.name: e.healthy for e in rt.pool.engines}
    redis_ok = rt.store is not None and await rt.store.ping()
    ready = any(engines.values())
    body = Readiness(
        ready=ready,
        engines_ready=sum(engines.values()),
        engines_total=len(engines),
        redis=redis_ok,
        engines=engines if engine_visible(request) else None,
    )
    return web.json_response(
        text=body.model_dump_json(exclude_none=True), status=200 if ready else 503
    )


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    for e in rt.pool.engines:  # read at scrape time: no gauge update on the request path
        rt.metrics.child(rt.metrics.inflight, e.name).set(e.inflight)
    return web.Response(body=rt.metrics.render(), headers={"Content-Type": rt.metrics.content_type})


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Requests by route template and final status (outside the error middleware)."""
    resp = await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    metrics = request.app[RUNTIME].metrics
    metrics.child(metrics.requests, route, str(resp.status)).inc()
    return resp


def add_routes(app: web.Application) -> None:
    for path in PROXIED_ROUTES:
        app.router.add_post(path, proxy_request)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
