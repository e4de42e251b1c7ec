"""The request path to an engine and back: place, send (failing over), relay, account.

``forward`` is the pipeline; each step is one function below. Placement hashes the client's
``raw`` body: stripping a hint re-serializes the JSON, and the same prompt sent with and
without a hint must find the same replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientResponse, web
from multidict import CIMultiDict

from adapters.base import EngineAdapter
from policy.admission import admission_priority, admission_slack_ms
from policy.prefix_index import hash_chain
from proxy.access import AccessInfo, access_info
from proxy.errors import UpstreamError
from proxy.keys import SessionKey
from proxy.placement import PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS, Affinity, Prefill
from proxy.relay import end_broken_stream, engine_visible, pump_stream
from proxy.runtime import Registration, Runtime
from proxy.store import Usage
from proxy.upstream import Engine, response_headers, upstream_headers
from proxy.usage import UsageSniffer, ask_for_usage

log = logging.getLogger("kvkeeper.forward")

HINT_HEADER = "X-KVKeeper-Hint"
# deadline slack per 1,000 prompt tokens the engine computes (admission order)
SLACK_MS_PER_KTOK = 100.0
_BUFFER_LIMIT = 1 << 20  # non-streamed bodies up to this size are relayed in one write


@dataclass(slots=True)
class Outbound:
    """A client request on its way to an engine (``body``: hints stripped)."""

    request: web.Request
    body: bytes
    raw: bytes
    json_body: dict[str, Any] | None
    key: SessionKey | None
    edits: bool = False
    pinned: Engine | None = None  # it must run there (a stored Responses API answer)

    @property
    def info(self) -> AccessInfo:
        return access_info(self.request)


@dataclass(slots=True)
class Forwarded:
    """What one forwarded request came to."""

    response: web.StreamResponse
    engine: Engine
    usage: Usage | None
    registration: Registration | None

    @property
    def ok(self) -> bool:
        return self.response.status < 400


async def forward(
    rt: Runtime, out: Outbound, registering: Registration | asyncio.Future[Registration] | None
) -> Forwarded:
    """Place, send, relay, account. A hinted request waits for its registration (when it is
    not there at once) before choosing an engine only when the choice depends on the session
    (several engines, a prompt too short to place by its prefix); either way the outcome
    header needs it before the answer's headers go out."""
    chain = _chain(rt, out.raw)
    reg: Registration | None
    if isinstance(registering, Registration):
        reg, pending = registering, None
    else:
        pending = registering
        reg = await pending if pending is not None and _by_session(rt, chain) else None
    order = await _order(rt, out, reg, chain)
    headers = _headers(rt, out, order)
    prefill = Prefill(rt.placer, order[0].name, len(out.body), chain) if chain and order else None
    engine, upstream, sent_at, with_usage = await _send(rt, out, order, headers, prefill)
    try:
        if pending is not None and reg is None:
            reg = await pending
        outcome = _outcome(out, reg, upstream.status)
        if upstream.status >= 400 and "json" not in upstream.content_type:
            detail = (await upstream.read())[:200].decode(errors="replace")
            raise UpstreamError(
                f"engine {engine.name} answered {upstream.status}: {detail}",
                status=upstream.status,
                code="upstream_error",
            )
        sniffer = UsageSniffer(upstream.content_type, upstream.headers.get("Content-Encoding"))
        sniffer.strip_usage = with_usage and sniffer.sse and sniffer.enabled
        if prefill is not None:
            sniffer.on_first_byte.append(prefill.release)
        shown = engine.name if engine_visible(out.request) else None
        resp = await relay(rt, out, upstream, sniffer, engine, shown, outcome)
    except BaseException:  # client gone, cancelled or refused: drop the engine's connection now
        upstream.close()
        raise
    finally:
        engine.inflight -= 1
        upstream.release()
        if prefill is not None:
            prefill.release()
    usage = _account(rt, out, engine, sniffer, sent_at)
    return Forwarded(resp, engine, usage, reg)


def _by_session(rt: Runtime, chain: list[bytes]) -> bool:
    """Whether placement depends on the session: several engines, no prompt chain."""
    return len(rt.pool.engines) > 1 and not chain


def _chain(rt: Runtime, raw: bytes) -> list[bytes]:
    """The prompt's prefix chain, for placement by prefix (several engines only)."""
    if len(rt.pool.engines) <= 1:
        return []
    return hash_chain(raw, PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS)


async def _order(
    rt: Runtime, out: Outbound, reg: Registration | None, chain: list[bytes]
) -> list[Engine]:
    """The engines to try, best first; a pinned engine leads whatever placement says."""
    up = reg.upserted if reg is not None else None
    affinity = Affinity(up.engine, up.parent_engine) if up is not None else None
    order = rt.placer.order(affinity, out.key, chain)
    if not order:  # no engine ready: check them now (bounded by the check's timeout)
        await rt.pool.recheck()
        order = rt.placer.order(affinity, out.key, chain)
    if out.pinned is not None:
        order = [out.pinned, *(e for e in order if e is not out.pinned)]
    return order


def _headers(rt: Runtime, out: Outbound, order: list[Engine]) -> CIMultiDict[str]:
    """The engine's request headers; with admission order on, the engine priority from the
    tokens it would compute (``policy.admission``) unless the client set its own."""
    adapter = order[0].adapter if order else None
    headers = upstream_headers(
        out.request.headers,
        out.info.request_id,
        hop_by_hop=adapter.hop_by_hop if adapter is not None else frozenset(),
        api_key=rt.settings.upstream.api_key,
        drop_auth=rt.tenants.multi_tenant,
    )
    # configured on, or (unset) the engine reported that it schedules by priority
    if adapter is None or not adapter.prioritized or adapter.priority_header is None:
        return headers
    if not _client_priority(out, adapter):
        cost = rt.placer.uncached_estimate(order[0], len(out.body), out.key)
        slack_ms = admission_slack_ms(cost, SLACK_MS_PER_KTOK)
        headers[adapter.priority_header] = str(admission_priority(time.time(), slack_ms))
        rt.metrics.admission_slack.observe(slack_ms / 1000.0)
    return headers


def _client_priority(out: Outbound, adapter: EngineAdapter) -> bool:
    """Whether the client set its own engine priority (header, or body field: searched in the
    raw bytes when the body was not parsed)."""
    if adapter.priority_header and adapter.priority_header in out.request.headers:
        return True
    if out.json_body is not None:
        return adapter.priority_field in out.json_body
    return _field_pattern(adapter.priority_field).search(out.raw) is not None


@functools.cache
def _field_pattern(name: str) -> re.Pattern[bytes]:
    return re.compile(b'"' + re.escape(name.encode()) + rb'"\s*:')


async def _send(
    rt: Runtime,
    out: Outbound,
    order: list[Engine],
    headers: CIMultiDict[str],
    prefill: Prefill | None,
) -> tuple[Engine, ClientResponse, float, bool]:
    """Open the request on the first engine that takes it: (engine, response, sent at,
    whether usage was asked for on the client's behalf)."""
    request = out.request
    # a stream that did not ask for usage asks for it here (dropped again on the way back)
    with_usage = ask_for_usage(request.path, out.body, out.json_body)
    sent = out.body if with_usage is None else with_usage
    try:
        sent_at = time.perf_counter()
        engine, upstream = await rt.pool.open(order, request.method, request.path_qs, headers, sent)
    except BaseException:
        if prefill is not None:
            prefill.release()
        raise
    rt.metrics.child(rt.metrics.engine_requests, engine.name).inc()
    out.info.engine = engine.name
    if prefill is not None and engine is not order[0]:  # failed over: its prefill moves too
        prefill.move(engine.name)
    return engine, upstream, sent_at, with_usage is not None


def _outcome(out: Outbound, reg: Registration | None, status: int) -> str | None:
    """The X-KVKeeper-Hint value (None: not a hinted request)."""
    if reg is None:
        return None
    outcome = reg.outcome + ("; edits=deferred" if out.edits else "")
    if status >= 400:  # its session is not kept (unregister_failed)
        outcome = f"rejected; reason=upstream_status_{status}"
    out.info.hint = outcome
    return outcome


async def relay(
    rt: Runtime,
    out: Outbound,
    upstream: ClientResponse,
    sniffer: UsageSniffer,
    engine: Engine,
    shown: str | None,
    outcome: str | None,
) -> web.StreamResponse:
    """Send the engine's answer to the client unchanged (headers filtered, ours added). An
    engine that fails mid-answer, or stalls between chunks, ends it cleanly."""
    request, request_id = out.request, out.info.request_id
    headers = response_headers(upstream.headers, engine.adapter.hop_by_hop)
    headers["X-Request-Id"] = request_id
    if shown is not None:  # engine addresses: the admin's (or every caller's, if configured)
        headers["X-KVKeeper-Engine"] = shown
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
    stall_s = rt.settings.upstream.stream_stall_timeout_s
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


def _account(
    rt: Runtime, out: Outbound, engine: Engine, sniffer: UsageSniffer, sent_at: float
) -> Usage | None:
    """Latency and token metrics of a relayed answer; its usage, when it told one."""
    route, info, m = out.request.path, out.info, rt.metrics
    if sniffer.first_byte_at is not None:
        info.ttft_s = sniffer.first_byte_at - sent_at
        m.child(m.ttft, route, engine.name).observe(info.ttft_s)
        m.child(m.engine_ttft, engine.name).observe(info.ttft_s)
    m.child(m.upstream_latency, route, engine.name).observe(time.perf_counter() - sent_at)
    usage = sniffer.finish()
    info.response_id = sniffer.response_id
    if usage is not None:
        info.prompt_tokens, info.cached_tokens = usage.prompt_tokens, usage.cached_tokens
        rt.placer.learn_size(len(out.body), usage.prompt_tokens)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        m.child(m.engine_prompt_tokens, engine.name).inc(usage.prompt_tokens)
        m.child(m.engine_cached_tokens, engine.name).inc(usage.cached_tokens)
        if rt.retention is not None:
            rt.retention.served(engine.name, usage.prompt_tokens)
    return usage
