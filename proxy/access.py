"""The access log: one line per request, and the per-request facts the data plane fills in.

Fields: request id (the client's ``X-Request-Id`` when it sent one), method, route, status,
tenant, engine, TTFT and total time, prompt and cached tokens, and the hint outcome. Never the
prompt. Probes (/healthz, /readyz, /metrics) are logged at DEBUG, everything else at INFO, on the
``kvkeeper.access`` logger.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.logs import FIELDS

log = logging.getLogger("kvkeeper.access")

REQUEST_ID = "X-Request-Id"
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
_MAX_ID = 128  # a client's request id longer than this is replaced (it is logged and echoed)


@dataclass(slots=True)
class AccessInfo:
    """What the handlers learned about one request; the middleware logs it at the end."""

    request_id: str
    tenant: str | None = None
    engine: str | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    hint: str | None = None  # the X-KVKeeper-Hint outcome
    response_id: str | None = None  # a Responses API answer's id (not logged)


_KEY = web.RequestKey("kvkeeper.access", AccessInfo)


def _request_id(request: web.Request) -> str:
    given = request.headers.get(REQUEST_ID, "")
    if given and len(given) <= _MAX_ID and given.isprintable():
        return given
    return os.urandom(16).hex()


def access_info(request: web.Request) -> AccessInfo:
    """This request's record (made on first use when the middleware is not installed)."""
    info = request.get(_KEY)
    if info is None:
        info = AccessInfo(_request_id(request))
        request[_KEY] = info
    return info


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


@web.middleware
async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware: assigns the request id and logs the finished request."""
    started = time.perf_counter()
    info = access_info(request)
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        if not resp.prepared and REQUEST_ID not in resp.headers:
            resp.headers[REQUEST_ID] = info.request_id
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away first (nginx's convention)
        raise
    finally:
        level = logging.DEBUG if request.path in _PROBES else logging.INFO
        if log.isEnabledFor(level):
            fields = {
                "request_id": info.request_id,
                "method": request.method,
                "route": request.path,
                "status": status,
                "tenant": info.tenant,
                "engine": info.engine,
                "ttft_ms": _ms(info.ttft_s),
                "duration_ms": _ms(time.perf_counter() - started),
                "prompt_tokens": info.prompt_tokens,
                "cached_tokens": info.cached_tokens,
                "hint": info.hint,
            }
            # the fields go out as key=value (text) or as JSON keys (proxy/logs.py)
            log.log(level, "request", extra={FIELDS: fields})
