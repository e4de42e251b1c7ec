"""The data plane: OpenAI / Anthropic routes proxied byte for byte, plus health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from typing import Any

from aiohttp import ClientResponse, web
from aiohttp.typedefs import Handler

from adapters.vllm import PRIORITY_HEADER
from policy.admission import admission_priority, admission_slack_ms
from policy.prefix_index import hash_chain
from proxy.access import access_info
from proxy.edits import outcome_header
from proxy.errors import NotFound, StoreUnavailable, UpstreamError
from proxy.hints import Hint, parse_request
from proxy.passthrough import previous_response_id, remember_response, response_engine
from proxy.relay import end_broken_stream, engine_visible, pump_stream
from proxy.runtime import PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS, RUNTIME, Registration, Runtime
from proxy.store import StoreDown, Upserted, Usage
from proxy.upstream import Engine, response_headers, upstream_headers
from proxy.usage import UsageSniffer, ask_for_usage

log = logging.getLogger("kvkeeper.routes")

PROXIED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
HINT_HEADER = "X-KVKeeper-Hint"
_BUFFER_LIMIT = 1 << 20  # non-streamed bodies up to this size are relayed in one write
_STREAMED = re.compile(rb'"stream"\s*:\s*true')  # the dispatch gate holds streamed requests only
_PRIORITY_FIELD = re.compile(rb'"priority"\s*:')  # a client's own vLLM priority (body not parsed)


async def proxy_request(request: web.Request) -> web.StreamResponse:
    """Parse hints, register the session, forward to an engine, stream the answer back."""
    rt = request.app[RUNTIME]
    tenant = rt.tenants.tenant_for(request.headers)
    access_info(request).tenant = tenant
    raw = await request.read()
    parsed = parse_request(request.path, request.headers, raw, rt.settings.limits)
    hint = parsed.hint
    registering: asyncio.Task[Registration] | None = None
    if hint is not None:
        for dialect in hint.dialects:
            rt.metrics.child(rt.metrics.hints, dialect).inc()
        if hint.manage_request:
            access_info(request).hint = "manage_request"
            return await _manage(rt, tenant, hint)
        # the Redis round trip runs while the request travels to the engine
        registering = asyncio.create_task(rt.register(tenant, hint))
    session = (tenant, hint.session_id) if hint is not None else None
    # a Responses request continuing a stored response runs where that response is stored
    previous = previous_response_id(request.path, parsed.json_body, raw)
    pinned = await response_engine(request, tenant, previous) if previous else None
    failed = True
    try:
        resp, engine, usage, reg = await _forward(
            rt,
            request,
            parsed.body,
            raw,
            registering,
            session,
            edits=bool(hint and hint.edits),
            prioritize=rt.settings.retention.admission_priority is not False
            and not _client_priority(request, parsed.json_body, raw),
            pinned=pinned,
        )
        failed = resp.status >= 400
    finally:
        if registering is not None and not registering.done():
            rt.keep(registering)  # forwarding failed first: let the registration finish
        if registering is not None and hint is not None and failed:
            rt.spawn(rt.unregister_failed(tenant, hint, registering))
    response_id = access_info(request).response_id
    if response_id is not None and resp.status < 400:
        remember_response(request, tenant, response_id, engine.name)
    if hint is not None and reg is not None and reg.upserted is not None and resp.status < 400:
        _after(rt, tenant, hint, reg.upserted, request.path, parsed.body, engine, usage)
    return resp


def _prioritized(rt: Runtime, engine: str) -> bool:
    """Whether requests to ``engine`` get an admission priority: ``admission_priority`` when
    set, else (None) when the engine said it runs ``--scheduling-policy priority``."""
    setting = rt.settings.retention.admission_priority
    es = rt.retention.engines.get(engine) if rt.retention is not None else None
    if es is None:
        return setting is True
    return es.adapter.prioritized


def _client_priority(request: web.Request, body: dict[str, Any] | None, raw: bytes) -> bool:
    """Whether the client set its own vLLM priority (header, or body field: searched in the raw
    bytes when the body was not parsed)."""
    if PRIORITY_HEADER in request.headers:
        return True
    return "priority" in body if body is not None else _PRIORITY_FIELD.search(raw) is not None


async def _forward(
    rt: Runtime,
    request: web.Request,
    body: bytes,
    raw: bytes,
    registering: asyncio.Task[Registration] | None,
    session: tuple[str, str] | None,
    *,
    edits: bool,
    prioritize: bool,
    pinned: Engine | None = None,
) -> tuple[web.StreamResponse, Engine, Usage | None, Registration | None]:
    """Send the request (``body``, hints stripped) to the chosen engine (failing over) and
    relay its answer. Placement hashes the client's ``raw`` body: stripping a hint re-serializes
    the JSON, and the same prompt sent with and without a hint must find the same replica.

    A hinted request waits for its registration before choosing an engine only when the choice
    depends on the session (several engines, a prompt too short to place by its prefix); either
    way the outcome header needs it before the answer's headers go out. ``prioritize``: set the
    engine's admission priority from the tokens it would compute (policy/admission.py).
    """
    route = request.path
    info = access_info(request)
    request_id = info.request_id
    headers = upstream_headers(
        request.headers,
        request_id,
        api_key=rt.settings.upstream.api_key,
        drop_auth=rt.tenants.multi_tenant,
    )
    reg = None
    chain: list[bytes] = []
    if len(rt.pool.engines) > 1:  # placement by the prompt's prefix chain, else by the session
        chain = hash_chain(raw, PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS)
        if registering is not None and not chain:
            reg = await registering
    order = rt.engine_order(reg.upserted if reg else None, session, chain)
    if not order:  # no engine ready: check them now (bounded by the check's timeout)
        await rt.pool.recheck()
        order = rt.engine_order(reg.upserted if reg else None, session, chain)
    if pinned is not None:  # it must run there (a stored response): placement does not choose
        order = [pinned, *(e for e in order if e is not pinned)]
    gate, ticket = rt.dispatch, None
    prioritize = prioritize and bool(order) and _prioritized(rt, order[0].name)
    if order and (gate is not None or prioritize):
        cost, resident = rt.uncached_estimate(order[0].name, len(body), session)
        if gate is not None:
            ticket = await gate.enter(order[0].name, cost, hold=_STREAMED.search(body) is not None)
        if prioritize:  # stamped when it leaves, after any wait at the gate
            r = rt.settings.retention
            slack_ms = admission_slack_ms(
                cost,
                r.priority_slack_ms_per_ktok,
                resident_tokens=resident,
                credit_ms_per_ktok=r.priority_resident_credit_ms_per_ktok,
            )
            headers[PRIORITY_HEADER] = str(admission_priority(time.time(), slack_ms))
            rt.metrics.admission_slack.observe(slack_ms / 1000.0)
    prefill = None
    if chain and order:  # recorded now: requests placed while this one waits must see them
        prefill = _Prefill(rt, order[0].name, len(body), chain)
        rt.placed(order[0].name, chain)
    try:
        sent_at = time.perf_counter()
        # a stream that did not ask for usage asks for it here (dropped again on the way back)
        with_usage = ask_for_usage(route, body, None)
        sent = body if with_usage is None else with_usage
        engine, upstream = await rt.pool.open(order, request.method, request.path_qs, headers, sent)
        rt.metrics.child(rt.metrics.engine_requests, engine.name).inc()
        info.engine = engine.name
        if prefill is not None and engine is not order[0]:  # failed over
            prefill.release()
            prefill = _Prefill(rt, engine.name, len(body), chain)
            rt.placed(engine.name, chain)
    except BaseException:
        if gate is not None and ticket is not None:
            gate.leave(ticket)
        if prefill is not None:
            prefill.release()
        raise
    try:
        if registering is not None and reg is None:
            reg = await registering
        outcome = None
        if reg is not None:
            outcome = reg.outcome + ("; edits=deferred" if edits else "")
            if upstream.status >= 400:  # its session is not kept (unregister_failed)
                outcome = f"rejected; reason=upstream_status_{upstream.status}"
            info.hint = outcome
        if upstream.status >= 400 and "json" not in upstream.content_type:
            detail = (await upstream.read())[:200].decode(errors="replace")
            raise UpstreamError(
                f"engine {engine.name} answered {upstream.status}: {detail}",
                status=upstream.status,
                code="upstream_error",
            )
        sniffer = UsageSniffer(upstream.content_type, upstream.headers.get("Content-Encoding"))
        sniffer.strip_usage = with_usage is not None and sniffer.sse and sniffer.enabled
        if gate is not None and ticket is not None:
            sniffer.on_first_byte.append(functools.partial(gate.started, ticket))
        if prefill is not None:
            sniffer.on_first_byte.append(prefill.release)
        shown = engine_visible(request)
        resp = await _relay(
            request,
            upstream,
            sniffer,
            engine.name if shown else None,
            request_id,
            outcome,
            rt.settings.upstream.stream_stall_timeout_s,
        )
    except BaseException:  # client gone, cancelled or refused: drop the engine's connection now
        upstream.close()
        raise
    finally:
        engine.inflight -= 1
        upstream.release()
        if gate is not None and ticket is not None:
            gate.leave(ticket)
        if prefill is not None:
            prefill.release()
    if sniffer.first_byte_at is not None:
        info.ttft_s = sniffer.first_byte_at - sent_at
        rt.metrics.child(rt.metrics.ttft, route, engine.name).observe(info.ttft_s)
        rt.metrics.child(rt.metrics.engine_ttft, engine.name).observe(info.ttft_s)
    rt.metrics.child(rt.metrics.upstream_latency, route, engine.name).observe(
        time.perf_counter() - sent_at
    )
    usage = sniffer.finish()
    info.response_id = sniffer.response_id
    if usage is not None:
        info.prompt_tokens, info.cached_tokens = usage.prompt_tokens, usage.cached_tokens
        rt.learn_size(len(body), usage.prompt_tokens)
        rt.metrics.prompt_tokens.inc(usage.prompt_tokens)
        rt.metrics.cached_tokens.inc(usage.cached_tokens)
        rt.metrics.child(rt.metrics.engine_prompt_tokens, engine.name).inc(usage.prompt_tokens)
        rt.metrics.child(rt.metrics.engine_cached_tokens, engine.name).inc(usage.cached_tokens)
        if rt.retention is not None:
            rt.retention.served(engine.name, usage.prompt_tokens)
    return resp, engine, usage, reg


class _Prefill:
    """A request's uncached prompt tokens counted as prefill queued at its engine (placement
    weighs them), released once: at the first byte back, or when the request ends without."""

    __slots__ = ("engine", "rt", "tokens")

    def __init__(self, rt: Runtime, engine: str, body_bytes: int, chain: list[bytes]) -> None:
        self.rt, self.engine = rt, engine
        self.tokens = rt.prefill_started(engine, body_bytes, chain)

    def release(self) -> None:
        if self.tokens:
            self.rt.prefill_done(self.engine, self.tokens)
            self.tokens = 0.0


async def _relay(
    request: web.Request,
    upstream: ClientResponse,
    sniffer: UsageSniffer,
    engine: str | None,
    request_id: str,
    outcome: str | None,
    stall_s: float = 60.0,
) -> web.StreamResponse:
    """Send the engine's answer to the client unchanged (headers filtered, ours added). An
    engine that fails mid-answer, or stalls ``stall_s`` between chunks, ends it cleanly."""
    headers = response_headers(upstream.headers)
    headers["X-Request-Id"] = request_id
    if engine is not None:  # engine addresses: the admin's (or every caller's, if configured)
        headers["X-KVKeeper-Engine"] = engine
    if outcome is not None:
        headers[HINT_HEADER] = outcome
    size = upstream.content_length
    if not sniffer.sse and size is not None and size <= _BUFFER_LIMIT:
        # a small complete body: one write for headers + body instead of two
        body = await upstream.read()
        sniffer.mark_first_byte()
        sniffer.feed(body)
        resp = web.Response(
            status=upstream.status, reason=upstream.reason, body=body, headers=headers
        )
        await resp.prepare(request)
        await resp.write_eof()
        return resp
    stream = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    if size is not None:
        stream.content_length = size
    await stream.prepare(request)
    failure = await pump_stream(stream, upstream, sniffer, stall_s)
    if failure is not None:
        log.warning("engine failed mid-answer (request %s): %s", request_id, failure)
        await end_broken_stream(request, stream, sniffer.sse, failure)
        return stream
    # A client that closes as soon as it has read everything (after "data: [DONE]") makes
    # the final empty chunk fail; the answer was delivered, so it still counts and is recorded.
    with contextlib.suppress(ConnectionResetError):
        await stream.write_eof()
    return stream


def _after(
    rt: Runtime,
    tenant: str,
    hint: Hint,
    before: Upserted,
    route: str,
    body: bytes,
    engine: Engine,
    usage: Usage | None,
) -> None:
    """Record usage + context (buffered, written in batches), feed retention, run edits."""
    assert rt.completions is not None
    rt.completions.add(
        tenant,
        hint.session_id,
        engine=engine.name,
        usage=usage or Usage(),
        route=route,
        body=body,
        breakpoint=hint.breakpoint,
        block_offset=hint.block_offset,
        now=time.time(),
    )
    if rt.retention is not None:
        rt.retention.on_completion(engine.name, usage, before)
        if hint.agent_name and rt.retention.anchors is not None:
            rt.retention.anchors.observe(
                engine.name, tenant, hint.session_id, hint.agent_name, route, body, time.time()
            )
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
    body = {
        "object": "kvkeeper.management",
        "session_id": hint.session_id,
        "results": [r.to_json() for r in results],
    }
    headers = {HINT_HEADER: "accepted", "X-KVKeeper-Edits": outcome_header(results)}
    return web.json_response(body, headers=headers)


async def models(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    rt.tenants.tenant_for(request.headers)
    return web.json_response({"object": "list", "data": await rt.pool.models()})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 when at least one engine passed its last health check, else 503. Redis is
    reported but does not gate readiness: without it requests still flow, hints answer
    ``rejected; reason=store_unavailable`` (``kvkeeper_redis_up`` 0)."""
    rt = request.app[RUNTIME]
    engines = {e.name: e.healthy for e in rt.pool.engines}
    redis_ok = rt.store is not None and await rt.store.ping()
    ready = any(engines.values())
    body: dict[str, Any] = {
        "ready": ready,
        "engines_ready": sum(engines.values()),
        "engines_total": len(engines),
        "redis": redis_ok,
    }
    if engine_visible(request):
        body["engines"] = engines
    return web.json_response(body, status=200 if ready else 503)


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
