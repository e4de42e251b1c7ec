"""Every engine route kvkeeper does not handle itself, relayed byte for byte (the catch-all).

vLLM serves more than the four generation routes: ``/v1/messages/count_tokens``,
``GET /v1/models/{id}``, ``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/health``,
``/version``, ``GET /v1/responses/{id}`` ... Each is sent to one engine with its body unchanged
(hints, where a body or the headers carry them, stripped as on the generation routes) and the
engine's answer comes back unchanged. Placement keeps together what must stay together:

- a hinted request (``count_tokens`` with its session's headers or Anthropic cache breakpoints)
  goes to the engine its session last used;
- ``/v1/responses/{id}`` (and a new response's ``previous_response_id``) goes to the engine that
  holds that response: kvkeeper remembers response id -> engine in Redis (``ResponseMap``);
- anything else goes to the least loaded healthy engine. A GET that one engine answers 404 is
  asked of the next (engines may serve different models or hold different responses).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections import OrderedDict

from aiohttp import ClientResponse, web
from redis.exceptions import RedisError

from proxy.access import REQUEST_ID, access_info
from proxy.errors import NotFound
from proxy.hints import parse_request
from proxy.relay import end_broken_stream, engine_visible, pump_stream
from proxy.runtime import RUNTIME, Runtime
from proxy.store import SessionStore, StoreDown
from proxy.upstream import Engine, response_headers, upstream_headers

log = logging.getLogger("kvkeeper.passthrough")

RESPONSE_ROUTE = "/v1/responses"
_RESPONSE_PATH = re.compile(r"^/v1/responses/([^/]{1,256})(?:/.*)?$")
# a new response continuing a stored one; searched in the raw bytes when the body was not parsed
_PREVIOUS = re.compile(rb'"previous_response_id"\s*:\s*"([^"\\]{1,256})"')
# routes whose body is in another dialect's shape than their path says
_DIALECT_OF = {"/v1/messages/count_tokens": "/v1/messages"}
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
# how long the engine holding a Responses API id is remembered
RESPONSE_TTL_S = 86_400.0
_OWN_PREFIXES = ("/admin/", "/ui/")  # kvkeeper's own trees: never sent to an engine


class ResponseMap:
    """Responses API ids -> the engine that stored them, in Redis with a TTL (fail open).

    The newest ids are also kept in this process: a client continuing a response the moment it
    arrived must not race the Redis write (other kvkeeper replicas read Redis)."""

    RECENT = 10_000  # ids kept in memory

    def __init__(self, store: SessionStore, ttl_s: float = RESPONSE_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._recent: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def _key(self, tenant: str, response_id: str) -> str:
        return self.store.key("resp", tenant, response_id)

    def note(self, tenant: str, response_id: str, engine: str) -> None:
        """Remember in this process at once (no I/O); :meth:`remember` writes Redis."""
        self._recent[(tenant, response_id)] = (engine, time.monotonic() + self.ttl_s)
        self._recent.move_to_end((tenant, response_id))
        while len(self._recent) > self.RECENT:
            self._recent.popitem(last=False)

    async def remember(self, tenant: str, response_id: str, engine: str) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.store.redis.set(
                self._key(tenant, response_id), engine, ex=max(1, int(self.ttl_s))
            )

    async def engine_of(self, tenant: str, response_id: str) -> str | None:
        recent = self._recent.get((tenant, response_id))
        if recent is not None and recent[1] > time.monotonic():
            return recent[0]
        try:
            raw = await self.store.redis.get(self._key(tenant, response_id))
        except (RedisError, OSError, TimeoutError):
            return None
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)


RESPONSES = web.AppKey("responses", ResponseMap)


def previous_response_id(route: str, body: dict[str, object] | None, raw: bytes) -> str | None:
    """The stored response a new ``/v1/responses`` request continues, if any."""
    if route != RESPONSE_ROUTE:
        return None
    if body is not None:
        value = body.get("previous_response_id")
        return value if isinstance(value, str) and value else None
    found = _PREVIOUS.search(raw)
    return found.group(1).decode(errors="replace") if found else None


async def response_engine(request: web.Request, tenant: str, response_id: str) -> Engine | None:
    """The healthy engine that holds ``response_id``, when kvkeeper saw it made."""
    responses = request.app.get(RESPONSES)
    if responses is None:
        return None
    name = await responses.engine_of(tenant, response_id)
    engine = request.app[RUNTIME].pool.get(name)
    return engine if engine is not None and engine.healthy else None


def remember_response(request: web.Request, tenant: str, response_id: str, engine: str) -> None:
    """Record where a new response lives (off the hot path)."""
    responses = request.app.get(RESPONSES)
    if responses is not None:
        responses.note(tenant, response_id, engine)
        request.app[RUNTIME].spawn(responses.remember(tenant, response_id, engine))


async def session_engine(rt: Runtime, tenant: str, session_id: str) -> Engine | None:
    """The healthy engine the session's last request ran on (buffered completion, else Redis)."""
    name = None
    latest = rt.completions.latest(tenant, session_id) if rt.completions is not None else None
    if latest is not None:
        name = latest[0]
    elif rt.store is not None:
        with contextlib.suppress(StoreDown):
            session = await rt.store.get(tenant, session_id)
            name = session.engine if session is not None else None
    engine = rt.pool.get(name)
    return engine if engine is not None and engine.healthy else None


async def relay(request: web.Request) -> web.StreamResponse:
    """The catch-all handler: one engine's answer to this request, unchanged."""
    if request.path.startswith(_OWN_PREFIXES):
        raise NotFound(f"no route {request.method} {request.path}", code="not_found")
    rt = request.app[RUNTIME]
    info = access_info(request)
    tenant = rt.tenants.tenant_for(request.headers)
    info.tenant = tenant
    raw = await request.read()
    json_body = not raw or "json" in request.content_type
    dialect = _DIALECT_OF.get(request.path, request.path)
    parsed = parse_request(dialect, request.headers, raw if json_body else b"", rt.settings.limits)
    body = parsed.body if json_body else raw
    pinned: Engine | None = None
    found = _RESPONSE_PATH.match(request.path)
    if found is not None:
        pinned = await response_engine(request, tenant, found.group(1))
    elif parsed.hint is not None:
        pinned = await session_engine(rt, tenant, parsed.hint.session_id)
    order = rt.placer.order(None, None)
    if not order:  # no engine ready: check them now, as the generation routes do
        await rt.pool.recheck()
        order = rt.placer.order(None, None)
    if pinned is not None:
        order = [pinned, *(e for e in order if e is not pinned)]
    hop_by_hop = order[0].adapter.hop_by_hop if order else frozenset()
    headers = upstream_headers(
        request.headers,
        info.request_id,
        hop_by_hop=hop_by_hop,
        api_key=rt.settings.upstream.api_key,
        drop_auth=rt.tenants.multi_tenant,
    )
    retry_404 = request.method in ("GET", "HEAD")
    while True:
        engine, upstream = await rt.pool.open(order, request.method, request.path_qs, headers, body)
        rest = order[order.index(engine) + 1 :]
        if retry_404 and upstream.status == 404 and any(e.healthy for e in rest):
            engine.inflight -= 1  # this engine does not have it: ask the next one
            upstream.release()
            order = rest
            continue
        break
    info.engine = engine.name
    try:
        shown = engine.name if engine_visible(request) else None
        return await _send(
            request,
            upstream,
            shown,
            info.request_id,
            rt.settings.upstream.stream_stall_timeout_s,
            engine.adapter.hop_by_hop,
        )
    except BaseException:  # client gone or cancelled: drop the engine's connection now
        upstream.close()
        raise
    finally:
        engine.inflight -= 1
        upstream.release()


async def _send(
    request: web.Request,
    upstream: ClientResponse,
    engine: str | None,
    request_id: str,
    stall_s: float,
    hop_by_hop: frozenset[str],
) -> web.StreamResponse:
    headers = response_headers(upstream.headers, hop_by_hop)
    headers[REQUEST_ID] = request_id
    if engine is not None:
        headers["X-KVKeeper-Engine"] = engine
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    if upstream.content_length is not None:
        resp.content_length = upstream.content_length
    await resp.prepare(request)
    failure = await pump_stream(resp, upstream, None, stall_s)
    if failure is not None:  # the engine failed mid-answer: end it cleanly
        sse = "text/event-stream" in upstream.content_type
        await end_broken_stream(request, resp, sse, failure)
        return resp
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def add_passthrough(app: web.Application) -> None:
    """Register the catch-all; call it after every other route (it matches every path)."""
    for method in _METHODS:
        app.router.add_route(method, "/{tail:.*}", relay)
