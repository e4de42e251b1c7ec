"""LMCache's multi-process control API over the simulator's CPU tier, on one port.

The real stack splits it over two processes: the coordinator
(``/healthz``, ``/instances``, ``/instances/usage``, ``/directory/lookup``, ``/cache/pins``,
``/quota...``) and the MP server (``/healthcheck``, ``/version``, ``/status``, ``/cache/clear``,
``DELETE /cache/objects``, ``/quota/{cache_salt}``). Their paths do not collide, so the
simulator serves both on ``--lmcache-port``; point both of an adapter's URLs at it.

Shapes follow cpu-lmcache.md and ``adapters/lmcache.py`` (pin counts per key, paged
``GET /cache/pins``, ``/instances`` giving each MP server's ``ip``/``http_port``).

Simulator specifics: one tier, reported as ``"l1"`` / ``"dram"`` (``DELETE /cache/objects``
with tier ``l1``, ``l2`` or ``all`` addresses it); ``model_name`` must equal the simulator's
``--model`` (else no placements, as with the real coordinator); quotas are stored and reported
but not enforced (as with the real ``LRU`` policy); ``/cache/prefetches`` completes at once
(there is no slower tier to load from).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from loadgen.sim.api import ENGINE, MODEL, error_middleware
from loadgen.sim.cpu_tier import CpuTier
from loadgen.sim.engine import SimEngine

INSTANCE_ID = "sim-lmcache-0"
QUOTAS = web.AppKey("quotas", dict[str, float])
ADDRESS = web.AppKey("address", dict[str, Any])  # {"ip", "http_port"} once bound
PREFETCHES = web.AppKey("prefetches", dict[str, int])


def _tier(request: web.Request) -> CpuTier:
    tier = request.app[ENGINE].cpu
    if tier is None:
        raise web.HTTPServiceUnavailable(text="the simulator runs without a CPU tier")
    return tier


def _chunk_bytes(engine: SimEngine, tier: CpuTier) -> int:
    return tier.chunk_tokens * engine.profile.kv_bytes_per_token


async def _body(request: web.Request) -> dict[str, Any]:
    body = await request.json()
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


def _tokens(body: dict[str, Any]) -> list[int]:
    tokens = body.get("token_ids")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise web.HTTPBadRequest(text="token_ids must be a list of integers")
    return tokens


def _key(request: web.Request, key: str, salt: str | None) -> dict[str, Any]:
    return {"chunk_hash_hex": key, "model_name": request.app[MODEL], "kv_rank": 0,
            "object_group_id": 0, "cache_salt": salt or ""}  # fmt: skip


def _salt(body: dict[str, Any]) -> str | None:
    """LMCache spells "no salt" as ""; the engine as None."""
    salt = body.get("cache_salt")
    return str(salt) if salt else None


def _model_matches(request: web.Request, body: dict[str, Any]) -> bool:
    return body.get("model_name") == request.app[MODEL]


# -- coordinator -------------------------------------------------------------------------------
async def lookup(request: web.Request) -> web.Response:
    """``{"chunks": n, "results": [{key, placements, access_count}]}``, one per full chunk."""
    body = await _body(request)
    tier, engine = _tier(request), request.app[ENGINE]
    salt = _salt(body)
    keys = tier.chunk_keys(_tokens(body), salt)
    match = _model_matches(request, body)
    results = []
    size = _chunk_bytes(engine, tier)
    levels = (("l1", "dram", tier.chunks), ("l2", "fs", tier.l2)) if match else ()
    for key in keys:
        found = [(name, backend, level[key]) for name, backend, level in levels if key in level]
        placements = [{"instance_id": INSTANCE_ID, "tier": name, "backend": backend,
                       "size_bytes": size} for name, backend, _ in found]  # fmt: skip
        results.append({"key": _key(request, key, salt), "placements": placements,
                        "access_count": found[0][2].access_count if found else 0})  # fmt: skip
    return web.json_response({"chunks": len(keys), "results": results})


async def pin(request: web.Request) -> web.Response:
    return await _set_pins(request, pinned=True)


async def unpin(request: web.Request) -> web.Response:
    return await _set_pins(request, pinned=False)


async def _set_pins(request: web.Request, *, pinned: bool) -> web.Response:
    """Pins count per key, stored or not; ``affected`` is the keys the full chunks resolve to."""
    body = await _body(request)
    tier, tokens, salt = _tier(request), _tokens(body), _salt(body)
    requested = len(tokens) // tier.chunk_tokens
    affected = 0
    if _model_matches(request, body):
        affected = tier.pin(tokens, salt) if pinned else tier.unpin(tokens, salt)
    status = "pinned" if pinned else "unpinned"
    return web.json_response({"requested": requested, "affected": affected, "status": status})


async def list_pins(request: web.Request) -> web.Response:
    """Paged: ``?offset=&limit=``; ``{"pins": [{"key", "pin_count"}], "total"}``."""
    tier = _tier(request)
    salts = {key: c.cache_salt for key, c in {**tier.l2, **tier.chunks}.items()}
    rows = [{"key": _key(request, key, salts.get(key)), "pin_count": count}
            for key, count in sorted(tier.pins.items())]  # fmt: skip
    offset = int(request.query.get("offset", "0"))
    limit = int(request.query.get("limit", "1000"))
    return web.json_response({"pins": rows[offset : offset + limit], "total": len(rows)})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy"})


async def instances(request: web.Request) -> web.Response:
    addr = request.app[ADDRESS]
    return web.json_response(
        {"instances": [{"instance_id": INSTANCE_ID, "status": "alive", **addr}]}
    )


async def instances_usage(request: web.Request) -> web.Response:
    tier, engine = _tier(request), request.app[ENGINE]
    size = _chunk_bytes(engine, tier)
    modules = [{"tier": "l1", "backend": "dram", "used_bytes": len(tier.chunks) * size,
                "capacity_bytes": tier.capacity * size}]  # fmt: skip
    if tier.l2_capacity > 0:
        modules.append({"tier": "l2", "backend": "fs", "used_bytes": len(tier.l2) * size,
                        "capacity_bytes": tier.l2_capacity * size})  # fmt: skip
    return web.json_response({"instances": [{"instance_id": INSTANCE_ID, "modules": modules}]})


# -- MP server ---------------------------------------------------------------------------------
async def healthcheck(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy"})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "kvkeeper-sim"})


async def status(request: web.Request) -> web.Response:
    tier, engine = _tier(request), request.app[ENGINE]
    size = _chunk_bytes(engine, tier)
    used, total = len(tier.chunks) * size, tier.capacity * size
    l1 = {"total_object_count": len(tier.chunks), "memory_used_bytes": used,
          "memory_total_bytes": total, "memory_usage_ratio": used / total if total else 0.0,
          "write_ttl_seconds": None, "read_ttl_seconds": None}  # fmt: skip
    storage = {"l1_managers": {"default": l1}, "l1_manager": l1, "l2_adapters": []}
    return web.json_response(
        {"chunk_size": tier.chunk_tokens, "storage_manager": storage, "worker_liveness": {}}
    )


async def prefetch(request: web.Request) -> web.Response:
    """Completes at once with the keys found; with an L2, the leading chunks found there are
    loaded back into L1 first (a one-level tier has nothing to move)."""
    body = await _body(request)
    tier, tokens = _tier(request), _tokens(body)
    keys = tier.chunk_keys(tokens, _salt(body))
    if not keys:
        return web.json_response({"status": "noop"})
    if not _model_matches(request, body):
        found = 0
    elif tier.l2_capacity > 0:
        found = len(tier.lookup_sources(tokens, _salt(body), keys))
        request.app[ENGINE].flush_events()
    else:
        found = sum(1 for k in keys if k in tier.chunks)
    request_id = f"prefetch-{len(request.app[PREFETCHES])}"
    request.app[PREFETCHES][request_id] = found
    return web.json_response({"request_id": request_id, "status": "submitted"})


async def prefetch_state(request: web.Request) -> web.Response:
    found = request.app[PREFETCHES].get(request.match_info["request_id"])
    if found is None:
        raise web.HTTPNotFound(text="unknown prefetch request")
    return web.json_response({"status": "completed", "found_keys": found})


async def clear(request: web.Request) -> web.Response:
    body = await _body(request) if request.can_read_body else {}
    tier_name = body.get("tier", "l1")
    if tier_name != "l1":
        raise web.HTTPBadRequest(text="only tier 'l1' can be cleared")
    _tier(request).clear()
    request.app[ENGINE].flush_events()
    return web.json_response({"status": "ok", "cleared": {"tier": "l1"}})


async def delete_objects(request: web.Request) -> web.Response:
    """Delete chunk keys from ``tier`` (``l1``, ``l2`` or ``all``; a one-level tier is both)."""
    body = await _body(request)
    keys = body.get("keys")
    if not isinstance(keys, list):
        raise web.HTTPBadRequest(text="keys must be a list of chunk keys")
    tier = _tier(request)
    level = str(body.get("tier", "all")) if tier.l2_capacity > 0 else "all"
    if level not in ("l1", "l2", "all"):
        raise web.HTTPBadRequest(text="tier must be 'l1', 'l2' or 'all'")
    deleted = sum(tier.remove(str(k.get("chunk_hash_hex", "")), level) for k in _dicts(keys))
    request.app[ENGINE].flush_events()
    return web.json_response({"deleted": deleted, "skipped": len(keys) - deleted, "ok": True})


def _dicts(items: Sequence[Any]) -> list[dict[str, Any]]:
    return [k for k in items if isinstance(k, dict)]


async def put_quota(request: web.Request) -> web.Response:
    body = await _body(request)
    limit = body.get("limit_gb")
    if not isinstance(limit, int | float) or limit < 0:
        raise web.HTTPBadRequest(text="limit_gb must be a non-negative number")
    salt = request.match_info["salt"]
    request.app[QUOTAS][salt] = float(limit)
    return web.json_response({"cache_salt": salt, "limit_gb": float(limit), "status": "ok"})


async def get_quota(request: web.Request) -> web.Response:
    salt = request.match_info["salt"]
    quotas = request.app[QUOTAS]
    return web.json_response({"cache_salt": salt, "limit_gb": quotas.get(salt, 0.0),
                              "current_usage_gb": _usage_gb(request).get(salt, 0.0),
                              "exists": salt in quotas})  # fmt: skip


async def delete_quota(request: web.Request) -> web.Response:
    salt = request.match_info["salt"]
    existed = request.app[QUOTAS].pop(salt, None) is not None
    return web.json_response({"cache_salt": salt, "status": "ok" if existed else "not_found"})


async def all_quotas(request: web.Request) -> web.Response:
    usage, quotas = _usage_gb(request), request.app[QUOTAS]
    by_salt = {s: {"limit_gb": quotas.get(s), "current_usage_gb": usage.get(s, 0.0)}
               for s in sorted(set(usage) | set(quotas))}  # fmt: skip
    return web.json_response({"by_cache_salt": by_salt})


def _usage_gb(request: web.Request) -> dict[str, float]:
    tier, engine = _tier(request), request.app[ENGINE]
    size = _chunk_bytes(engine, tier)
    return {salt: n * size / 2**30 for salt, n in tier.usage_by_salt().items()}


def create_lmcache_app(engine: SimEngine, model: str) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[ENGINE], app[MODEL], app[QUOTAS] = engine, model, {}
    app[ADDRESS], app[PREFETCHES] = {}, {}
    r = app.router
    r.add_post("/directory/lookup", lookup)
    r.add_post("/cache/pins", pin)
    r.add_delete("/cache/pins", unpin)
    r.add_get("/cache/pins", list_pins)
    r.add_get("/healthz", healthz)
    r.add_get("/instances", instances)
    r.add_get("/instances/usage", instances_usage)
    r.add_get("/healthcheck", healthcheck)
    r.add_get("/version", version)
    r.add_get("/status", status)
    r.add_post("/cache/clear", clear)
    r.add_post("/cache/prefetches", prefetch)
    r.add_get("/cache/prefetches/{request_id}", prefetch_state)
    r.add_delete("/cache/objects", delete_objects)
    r.add_get("/quota", all_quotas)
    r.add_put("/quota/{salt}", put_quota)
    r.add_get("/quota/{salt}", get_quota)
    r.add_delete("/quota/{salt}", delete_quota)
    return app
