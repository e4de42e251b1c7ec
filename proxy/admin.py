"""Admin REST under ``/admin`` (bearer token), and the OpenAPI document that describes it.

The operator token (``KVKEEPER_ADMIN_TOKEN``) sees every tenant; a tenant's API key sees only
that tenant's sessions. Redis down -> 503.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from proxy import jsonio, session_cursor
from proxy.admin_models import (
    EngineList,
    EngineRecord,
    SessionPage,
    SessionRecord,
    SessionTreeNode,
    SessionView,
)
from proxy.auth import Principal
from proxy.console_models import Freed, OperationOutcome
from proxy.errors import BadRequest, NotFound, StoreUnavailable
from proxy.hashcheck import HASH_CHECKS
from proxy.keys import SessionKey
from proxy.runtime import RUNTIME, Runtime
from proxy.store import STATES, Session, SessionStore, StoreDown

MAX_PAGE = 500
MAX_TREE_NODES = 1000
AdminHandler = Callable[[web.Request, Runtime, SessionStore, Principal], Awaitable[web.Response]]


def admin_route(fn: AdminHandler) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Authenticate, require the store, and turn Redis failures into 503."""

    async def handler(request: web.Request) -> web.Response:
        rt = request.app[RUNTIME]
        principal = rt.tenants.principal(request.headers, rt.settings.admin_token)
        if rt.store is None:
            raise StoreUnavailable("session store unavailable", code="store_unavailable")
        try:
            await rt.settle()
            return await fn(request, rt, rt.store, principal)
        except StoreDown as exc:
            raise StoreUnavailable(
                f"session store unavailable: {exc}", code="store_unavailable"
            ) from exc

    handler.__name__ = fn.__name__
    return handler


def int_query(
    request: web.Request, name: str, default: int, lo: int, hi: int, *, blank_ok: bool = False
) -> int:
    """Query parameter ``name`` as an integer in [lo, hi], ``default`` when absent (or empty,
    with ``blank_ok``); a clear 400 otherwise."""
    raw = request.query.get(name)
    if raw is None or (blank_ok and raw == ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer", param=name) from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be between {lo} and {hi}", param=name)
    return value


@admin_route
async def list_sessions(
    request: web.Request, rt: Runtime, store: SessionStore, principal: Principal
) -> web.Response:
    """Sessions by tenant, then by session id, after the cursor's position (a keyset, so a
    session used while an operator pages does not move between pages)."""
    state = request.query.get("state")
    if state is not None and state not in STATES:
        raise BadRequest(f"state must be one of {', '.join(STATES)}", param="state")
    limit = int_query(request, "limit", 50, 1, MAX_PAGE)
    requested, parent = request.query.get("tenant"), request.query.get("parent")
    scope = principal.scope(requested) if requested or principal.tenant else None
    digest = session_cursor.listing_digest(scope, parent, state)
    raw = request.query.get("cursor", "")
    at = session_cursor.decode(raw, digest) if raw else None
    if scope is not None and at is not None and at.tenant != scope:
        raise BadRequest("cursor belongs to another listing (other tenant)", param="cursor")
    tenants = [scope] if scope is not None else await store.tenants()
    if at is not None:  # tenants are visited by name: resume at the cursor's (or the next one)
        tenants = [t for t in tenants if t >= at.tenant]
    page: list[Session] = []
    next_at: session_cursor.Position | None = None
    for i, tenant in enumerate(tenants):
        after = at.after if at is not None and tenant == at.tenant else ""
        got, last = await store.list_sessions(
            tenant, parent=parent, state=state, after=after, limit=limit - len(page)
        )
        page.extend(got)
        if last is not None:
            next_at = session_cursor.Position(tenant, last)
            break
        if len(page) >= limit:
            next_at = session_cursor.Position(tenants[i + 1], "") if i + 1 < len(tenants) else None
            break
    now = time.time()
    body = SessionPage(
        data=[SessionRecord.of(s, now) for s in page],
        next_cursor=None if next_at is None else session_cursor.encode(next_at, digest),
    )
    return _answer(body)


def _answer(body: BaseModel) -> web.Response:
    """A model as the JSON answer: the wire format is the model's."""
    return web.json_response(text=body.model_dump_json())


async def _tree(store: SessionStore, root: Session) -> SessionTreeNode:
    """The session's subtree, breadth first, at most MAX_TREE_NODES nodes."""
    nodes = {root.session_id: SessionTreeNode(session_id=root.session_id, state=root.state)}
    frontier, count = [root], 1
    while frontier and count < MAX_TREE_NODES:
        ids = [c for s in frontier for c in s.children][: MAX_TREE_NODES - count]
        found = [s for s in await store.get_many(root.tenant, ids) if s is not None]
        for child in found:
            node = SessionTreeNode(session_id=child.session_id, state=child.state)
            nodes[child.session_id] = node
            if child.parent in nodes:
                nodes[child.parent].children.append(node)
        count += len(found)
        frontier = found
    return nodes[root.session_id]


@admin_route
async def get_session(
    request: web.Request, rt: Runtime, store: SessionStore, principal: Principal
) -> web.Response:
    tenant = principal.scope(request.query.get("tenant"))
    sid = request.match_info["session_id"]
    session = await store.get(tenant, sid)
    if session is None:
        raise NotFound(f"no session {sid!r}", code="unknown_session")
    body = SessionView(
        **SessionRecord.of(session, time.time()).model_dump(),
        tree=await _tree(store, session),
        residency=await rt.retention.residency(session) if rt.retention is not None else None,
    )
    return _answer(body)


OPERATIONS = ("pin", "offload", "prefetch", "evict")


@admin_route
async def session_operation(
    request: web.Request, rt: Runtime, store: SessionStore, principal: Principal
) -> web.Response:
    """``POST /admin/sessions/{id}/{pin|offload|prefetch|evict}`` with optional block range."""
    from proxy.hint_model import Edit
    from proxy.operations import SessionOps

    op = request.match_info["op"]
    if op not in OPERATIONS:
        raise NotFound(f"unknown operation {op!r}; one of {', '.join(OPERATIONS)}")
    tenant = principal.scope(request.query.get("tenant"))
    params = await _json_params(request)
    start, end, ttl = params.get("block_start"), params.get("block_end"), params.get("ttl")
    for name, value in (("block_start", start), ("block_end", end)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise BadRequest(f"{name} must be a non-negative integer", param=name)
    if (start is None) != (end is None) or (start is not None and end is not None and start >= end):
        raise BadRequest("block_start and block_end go together, with block_start < block_end")
    if ttl is not None and (
        not isinstance(ttl, int | float)
        or isinstance(ttl, bool)
        or not 0 < ttl <= rt.settings.limits.max_ttl_s
    ):
        raise BadRequest(f"ttl must be in (0, {rt.settings.limits.max_ttl_s:g}]", param="ttl")
    if not isinstance(rt.edits, SessionOps):
        raise BadRequest("retention is disabled on this proxy", code="retention_disabled")
    edit = Edit(op, start, end)  # type: ignore[arg-type]  # "pin" exists only here
    result = await rt.edits.run(tenant, request.match_info["session_id"], edit, ttl_s=ttl)
    if result.reason == "unknown_session":
        raise NotFound(f"no session {request.match_info['session_id']!r}", code="unknown_session")
    rt.metrics.edits.labels(op, result.status).inc()
    body = OperationOutcome(operation=op, **result.to_json())
    return web.json_response(text=body.model_dump_json(exclude_none=True))


async def _json_params(request: web.Request) -> dict[str, Any]:
    if not request.body_exists:
        return {}
    try:
        body = jsonio.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("body must be a JSON object", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object", code="invalid_json")
    unknown = set(body) - {"block_start", "block_end", "ttl"}
    if unknown:
        raise BadRequest(f"unknown fields: {sorted(unknown)}")
    return body


@admin_route
async def free_session(
    request: web.Request, rt: Runtime, store: SessionStore, principal: Principal
) -> web.Response:
    tenant = principal.scope(request.query.get("tenant"))
    sid = request.match_info["session_id"]
    tree = request.query.get("tree", "false").lower() in ("1", "true", "yes")
    freed = await store.free(tenant, sid, tree=tree)
    if not freed:
        raise NotFound(f"no session {sid!r}", code="unknown_session")
    rt.metrics.sessions_freed.labels("tree" if tree else "single").inc(len(freed))
    if rt.retention is not None:
        for gone in freed:
            rt.retention.forget(SessionKey(tenant, gone))
    if rt.longterm is not None:
        for gone in freed:
            await rt.longterm.release(tenant, gone)
    return web.json_response(text=Freed(freed=freed).model_dump_json())


async def list_engines(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    rt.tenants.principal(request.headers, rt.settings.admin_token)  # any admin principal
    checks = request.app[HASH_CHECKS]  # the block-hash self-check (proxy/hashcheck.py)
    data = [
        EngineRecord(
            name=e.name,
            url=e.url,
            healthy=e.healthy,
            inflight=e.inflight,
            last_error=e.last_error,
            last_check=e.last_check or None,
            models=e.models,
            events=e.spec.events,
            retention=rt.retention.engine_view(e.name) if rt.retention else None,
            hash_check=checks[e.name].view() if e.name in checks else None,
        )
        for e in rt.pool.engines
    ]
    return _answer(EngineList(data=data))


async def openapi(request: web.Request) -> web.Response:
    from proxy.openapi import document

    return web.json_response(document())


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/sessions", list_sessions)
    app.router.add_get("/admin/sessions/{session_id}", get_session)
    app.router.add_delete("/admin/sessions/{session_id}", free_session)
    app.router.add_post("/admin/sessions/{session_id}/{op}", session_operation)
    app.router.add_get("/admin/engines", list_engines)
    app.router.add_get("/openapi.json", openapi)
