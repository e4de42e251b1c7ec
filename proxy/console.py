"""The operator console: static pages under ``/ui`` and the admin JSON they read.

``/ui`` serves ``proxy/ui`` (HTML, CSS, JS shipped in the package; nothing is fetched from
elsewhere). The page asks for a bearer token and calls the admin API with it, so the console has
exactly the admin API's auth and tenant scoping: the operator token sees every tenant, a tenant's
API key only its own sessions. Its actions are the admin API's own routes (``DELETE`` and
``POST /admin/sessions/{id}/{op}``); what it reads besides them is here:

* ``GET /admin/console/forest``: the session forest, one page of whole trees, searchable on the
  server by session id, agent or parent (substring) and filterable by state;
* ``GET /admin/console/engines``: per engine health, load, horizon, pool, retention credit,
  touches, tier pins and a time series of hit rate and TTFT (``proxy/console_engines.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from aiohttp import web
from redis import exceptions as redis_errors

from proxy.admin import admin_route, int_query
from proxy.auth import Principal
from proxy.console_engines import CONSOLE_SERIES, SAMPLE_EVERY_S, Series, engines
from proxy.console_models import (
    ConsoleCounters,
    ConsoleSession,
    ForestNode,
    ForestPage,
    SessionDetail,
)
from proxy.errors import BadRequest, NotFound
from proxy.keys import SessionKey
from proxy.runtime import RUNTIME, Runtime
from proxy.store import SEP, STATES, Session, SessionStore, StoreDown

log = logging.getLogger("kvkeeper.console")

GPU = "GPU"
MAX_PAGE = 200  # trees per page
MAX_PAGE_NODES = 2000  # sessions per page, all trees together
SKELETON_TTL_S = 1.0  # a tenant's id/parent/agent/state skeleton is reused this long
DISPLAY_STATES = (*STATES, "expired")
# the page loads and calls nothing but this server (inline style attributes: the bars' widths)
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
_CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


# --- the session forest ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Bone:
    """What the forest needs of every session: enough to link, search and count."""

    sid: str
    parent: str | None
    agent: str | None
    display_state: str
    created: float


_BONE_FIELDS = ("parent", "agent", "state", "expiries", "ttl_until", "created")


def _display_state(state: str, expiries: int, ttl_until: float) -> str:
    return "expired" if state == "idle" and expiries > 0 and ttl_until == 0 else state


def _text(raw: Any) -> str | None:
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def _skeleton(store: SessionStore, tenant: str) -> list[_Bone]:
    """Every session of ``tenant``, newest first (two round trips, whatever the count)."""
    try:
        ids = [_text(i) or "" for i in await store.redis.zrevrange(store.index_key(tenant), 0, -1)]
        async with store.redis.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hmget(store.key("s", tenant, sid), *_BONE_FIELDS)
            rows = await pipe.execute()
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        raise StoreDown(f"redis unavailable: {exc}") from exc
    bones = []
    for i, sid in enumerate(ids):
        parent, agent, state, expiries, ttl_until, created = rows[i]
        if state is None:  # freed since the index was read
            continue
        bones.append(
            _Bone(
                sid,
                _text(parent) or None,
                _text(agent) or None,
                _display_state(_text(state) or "idle", int(expiries or 0), float(ttl_until or 0)),
                float(created or 0),
            )
        )
    return bones


@dataclass
class _Trees:
    """One tenant's sessions as a forest: children by parent, roots newest first."""

    tenant: str
    bones: dict[str, _Bone]
    children: dict[str, list[str]]
    roots: list[str]

    @classmethod
    def build(cls, tenant: str, bones: list[_Bone]) -> _Trees:
        by_id = {b.sid: b for b in bones}
        children: dict[str, list[str]] = {}
        roots = []
        for b in bones:
            if b.parent is not None and b.parent in by_id and b.parent != b.sid:
                children.setdefault(b.parent, []).append(b.sid)
            else:
                roots.append(b.sid)
        for kids in children.values():
            kids.sort(key=lambda sid: (by_id[sid].created, sid))  # as they were spawned
        return cls(tenant, by_id, children, roots)

    def walk(self, root: str) -> Iterable[str]:
        """The tree's ids, breadth first (a cycle cannot form: roots have no known parent)."""
        frontier = [root]
        while frontier:
            yield from frontier
            frontier = [c for sid in frontier for c in self.children.get(sid, ())]


def _matches(bone: _Bone, query: str) -> bool:
    return any(query in (v or "").lower() for v in (bone.sid, bone.agent, bone.parent))


@dataclass
class _Cache:
    skeletons: dict[tuple[str, str], tuple[float, list[_Bone]]] = field(default_factory=dict)


CONSOLE_CACHE = web.AppKey("console_cache", _Cache)


async def _bones(app: web.Application, store: SessionStore, tenant: str) -> list[_Bone]:
    cache = app[CONSOLE_CACHE]
    key = (store.ns, tenant)
    hit = cache.skeletons.get(key)
    now = time.monotonic()
    if hit is not None and now - hit[0] < SKELETON_TTL_S:
        return hit[1]
    bones = await _skeleton(store, tenant)
    cache.skeletons[key] = (now, bones)
    return bones


@admin_route
async def forest(
    request: web.Request, rt: Runtime, store: SessionStore, principal: Principal
) -> web.Response:
    """``GET /admin/console/forest``: one page of whole session trees (see the module doc)."""
    state = request.query.get("state") or None
    if state is not None and state not in DISPLAY_STATES:
        raise BadRequest(f"state must be one of {', '.join(DISPLAY_STATES)}", param="state")
    query = (request.query.get("q") or "").strip().lower()
    offset = int_query(request, "offset", 0, 0, 10_000_000, blank_ok=True)
    limit = int_query(request, "limit", 50, 1, MAX_PAGE, blank_ok=True)
    requested = request.query.get("tenant") or None
    tenants = (
        [principal.scope(requested)] if requested or principal.tenant else await store.tenants()
    )
    forests = [_Trees.build(t, await _bones(request.app, store, t)) for t in tenants]
    states = dict.fromkeys(DISPLAY_STATES, 0)
    total = matched = 0
    selected: list[tuple[_Trees, str, set[str]]] = []  # (forest, root, matching ids)
    for f in forests:
        total += len(f.bones)
        for b in f.bones.values():
            states[b.display_state] = states.get(b.display_state, 0) + 1
        for root in f.roots:
            hits = set()
            in_state = state is None
            for sid in f.walk(root):
                bone = f.bones[sid]
                if not query or _matches(bone, query):
                    hits.add(sid)
                in_state = in_state or bone.display_state == state
            if hits and in_state:
                selected.append((f, root, hits))
                matched += len(hits)
    page = selected[offset : offset + limit]
    trees = await _page_trees(rt, store, page)
    body = ForestPage(
        now=time.time(),
        tenant=tenants[0] if len(tenants) == 1 and (requested or principal.tenant) else None,
        total_sessions=total,
        total_trees=len(selected),
        matched_sessions=matched,
        states=states,
        offset=offset,
        limit=limit,
        trees=trees,
    )
    return web.json_response(text=body.model_dump_json())


async def _page_trees(
    rt: Runtime, store: SessionStore, page: list[tuple[_Trees, str, set[str]]]
) -> list[ForestNode]:
    """Full records of the page's trees (at most MAX_PAGE_NODES sessions), nested."""
    budget = MAX_PAGE_NODES
    wanted: list[tuple[_Trees, str, list[str]]] = []
    for f, root, _ in page:
        ids = []
        for sid in f.walk(root):
            if budget <= 0:
                break
            ids.append(sid)
            budget -= 1
        wanted.append((f, root, ids))
    pins = await _tier_pins(rt, store)
    out = []
    for (f, root, ids), (_, _, hits) in zip(wanted, page, strict=True):
        records = {s.session_id: s for s in await store.get_many(f.tenant, ids) if s is not None}
        now = time.time()
        nodes = {
            sid: ForestNode(session=_view(rt, s, now, sid in hits, pins))
            for sid, s in records.items()
        }
        for sid in ids:
            node = nodes.get(sid)
            if node is None:
                continue
            kids = f.children.get(sid, [])
            shown = [nodes[k] for k in kids if k in nodes]
            node.children = shown
            node.hidden_children = len(kids) - len(shown)
        if root in nodes:
            out.append(nodes[root])
    return out


@admin_route
async def session_detail(
    request: web.Request, rt: Runtime, store: SessionStore, principal: Principal
) -> web.Response:
    """``GET /admin/console/sessions/{id}``: one session, and where its prefix lives on every
    engine (its block ids learned now if retention had not yet)."""
    tenant = principal.scope(request.query.get("tenant") or None)
    sid = request.match_info["session_id"]
    session = await store.get(tenant, sid)
    if session is None:
        raise NotFound(f"no session {sid!r}", code="unknown_session")
    residency: dict[str, dict[str, int]] = {}
    if rt.retention is not None:
        blocks = await rt.retention.blocks.blocks_of(SessionKey(tenant, sid), session)
        for name, es in rt.retention.engines.items():
            residency[name] = es.signals.index.prefix_by_medium(blocks) if blocks else {}
    body = SessionDetail(
        session=_view(rt, session, time.time(), True, await _tier_pins(rt, store)),
        children=list(session.children),
        context_bytes=session.context_bytes,
        last_used=session.last_used or None,
        last_touch=session.last_touch or None,
        residency=residency,
    )
    return web.json_response(text=body.model_dump_json())


async def _tier_pins(rt: Runtime, store: SessionStore) -> set[tuple[str, str]]:
    """(tenant, session) pinned in any engine's offload tier, from the pin ledger."""
    if rt.retention is None:
        return set()
    pinned: set[tuple[str, str]] = set()
    for name, es in rt.retention.engines.items():
        if es.tier is not None:
            pinned.update(await store.tier_pins(name))
    return pinned


def _view(
    rt: Runtime, s: Session, now: float, matched: bool, pins: set[tuple[str, str]]
) -> ConsoleSession:
    c = s.counters
    gpu = tier = blocks = None
    if rt.retention is not None:
        known = rt.retention.blocks.known(SessionKey(s.tenant, s.session_id))
        if known:
            blocks = len(known)
            engine = rt.pool.get(s.engine)
            if engine is not None:
                media = engine.signals.index.prefix_by_medium(known)
                gpu = media.get(GPU, 0)
                tier = max((n for m, n in media.items() if m != GPU), default=0)
    prompt = c.get("prompt_tokens", 0)
    return ConsoleSession(
        session_id=s.session_id,
        tenant=s.tenant,
        state=s.state,
        display_state=_display_state(s.state, c.get("expiries", 0), s.ttl_until),
        parent_session_id=s.parent,
        agent=s.agent,
        engine=s.engine,
        created=s.created,
        last_seen=s.last_seen,
        ttl_s=s.ttl,
        ttl_guessed=s.guessed,
        ttl_until=s.ttl_until,
        ttl_left_s=round(s.ttl_left(now), 3),
        blocks=blocks,
        gpu_blocks=gpu,
        tier_blocks=tier,
        tier_pinned=s.state == "offloaded" or (s.tenant, s.session_id) in pins,
        matched=matched,
        counters=ConsoleCounters(
            **{k: c.get(k, 0) for k in ConsoleCounters.model_fields if k != "hit_rate"},
            hit_rate=round(c.get("cached_tokens", 0) / prompt, 4) if prompt else None,
        ),
    )


# --- static pages -----------------------------------------------------------------------------
async def page(request: web.Request) -> web.StreamResponse:
    """``/ui`` and ``/ui/{file}``: the console's own files (no data; the page asks with a token)."""
    name = request.match_info.get("name") or "index.html"
    if "/" in name or name.startswith(".") or SEP in name:
        raise web.HTTPNotFound()
    suffix = name[name.rfind(".") :] if "." in name else ""
    res = resources.files("proxy").joinpath("ui", name)
    if suffix not in _CONTENT_TYPES or not res.is_file():
        raise web.HTTPNotFound()
    return web.Response(
        body=res.read_bytes(),
        content_type=_CONTENT_TYPES[suffix],
        charset="utf-8",
        headers={
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": _CSP,
            "Referrer-Policy": "no-referrer",
        },
    )


async def redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/ui/")


def add_console_routes(app: web.Application) -> None:
    """The console's routes, and its sampler (started after the runtime, stopped before it)."""
    app[CONSOLE_CACHE] = _Cache()
    app[CONSOLE_SERIES] = Series()

    async def sampler(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                try:
                    app[CONSOLE_SERIES].sample(app[RUNTIME], time.time())
                except Exception:  # a view must never take the proxy down: log, keep sampling
                    log.exception("console sample failed")
                await asyncio.sleep(SAMPLE_EVERY_S)

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.cleanup_ctx.append(sampler)
    app.router.add_get("/ui", redirect)
    app.router.add_get("/ui/", page)
    app.router.add_get("/ui/{name}", page)
    app.router.add_get("/admin/console/forest", forest)
    app.router.add_get("/admin/console/engines", engines)
    app.router.add_get("/admin/console/sessions/{session_id}", session_detail)
