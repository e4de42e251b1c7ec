"""LMCache's multi-process stack as kvkeeper's offload tier (``OffloadTier``).

Two HTTP services:

- the coordinator (fleet-level): ``POST /directory/lookup`` (token ids -> chunk keys and their
  tier placements), ``POST|DELETE /cache/pins``, ``GET /instances``, ``GET /instances/usage``,
  ``GET /healthz``;
- the MP server (node-local): ``GET /healthcheck``, ``GET /status``, ``POST /cache/clear``
  (L1 only), ``DELETE /cache/objects`` (by key, ``tier`` ``l1``/``l2``/``all``), ``/quota/{salt}``.

LMCache addresses KV in 256-token chunks hashed its own way (not vLLM's block hashes), so every
call here takes the request's token ids FROM POSITION 0; only complete chunks count. Keys are
per model: ``model_name`` must be vLLM's ``--model`` value, not its served name.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from adapters import wire
from adapters.base import AdapterError, EngineRejected, EngineUnavailable

TIERS = ("l1", "l2")
DEFAULT_CHUNK_SIZE = 256  # LMCache's default, for a server that does not report its own


@dataclass(frozen=True, slots=True)
class LMCacheConfig:
    """Where the stack listens and how kvkeeper's requests map onto LMCache keys."""

    coordinator_url: str
    server_url: str
    model_name: str  # vLLM's --model value (LMCache keys carry it)
    world_size: int = 1
    cache_salt: str = ""  # default salt; calls may override (vLLM's request cache_salt)
    chunk_size: int | None = None  # tokens per chunk (None: as the MP server's /status says)
    timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one chunk key's bytes sit."""

    instance_id: str
    tier: str  # "l1" | "l2"
    backend: str  # "dram", "fs", ...
    size_bytes: int


@dataclass(frozen=True, slots=True)
class KeyPlacements:
    """One object key (wire form, as the servers take it back) and where it sits."""

    key: dict[str, Any]
    placements: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """One complete chunk of a prefix: one key per rank and object group."""

    index: int
    chunk_hash: str
    keys: tuple[KeyPlacements, ...]

    @property
    def stored(self) -> bool:
        """Loadable: every key of the chunk sits somewhere."""
        return all(k.placements for k in self.keys)

    @property
    def placed(self) -> bool:
        """Some key of the chunk sits somewhere (so there is something to delete)."""
        return any(k.placements for k in self.keys)

    @property
    def tiers(self) -> frozenset[str]:
        return frozenset(p.tier for k in self.keys for p in k.placements)


@dataclass(frozen=True, slots=True)
class DeleteResult:
    """Outcome of :meth:`LMCacheAdapter.delete_prefix`."""

    chunks: int  # stored chunks of the prefix that were deleted
    deleted_keys: dict[str, int]  # per tier as the servers report (l2: the keys sent)
    skipped_keys: int  # refused by a server (locked L1 objects, keys it does not hold)
    unpinned: int  # pins released (the highest pin count among the prefix's keys)


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One memory compartment of one MP server, from the coordinator's event stream."""

    instance_id: str
    tier: str
    backend: str
    used_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class L1Status:
    """The MP server's L1 (CPU memory) manager, from ``GET /status``."""

    objects: int
    used_bytes: int
    total_bytes: int
    chunk_size: int
    l2_adapters: int


@dataclass(frozen=True, slots=True)
class Quota:
    """A per-``cache_salt`` byte budget on the MP server (enforced with ``IsolatedLRU`` only)."""

    cache_salt: str
    limit_gb: float
    usage_gb: float
    exists: bool


class LMCacheAdapter:
    """Async client of one LMCache MP deployment (a coordinator and its MP servers)."""

    def __init__(self, session: aiohttp.ClientSession, config: LMCacheConfig) -> None:
        self._http = session
        self.config = config
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._chunk_size = config.chunk_size

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk: configured or learned from the server (else LMCache's default)."""
        return self._chunk_size or DEFAULT_CHUNK_SIZE

    async def chunk_tokens(self) -> int:
        """Tokens per chunk, asking the MP server once when neither configured nor learned."""
        if self._chunk_size is None:
            await self.l1_status()
        return self.chunk_size

    # -- OffloadTier --------------------------------------------------------------------------

    async def lookup(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Leading tokens stored in any tier: a multiple of the chunk size."""
        chunk_size = await self.chunk_tokens()
        chunks = await self.chunks(token_ids, cache_salt=cache_salt)
        leading = 0
        for chunk in chunks:
            if not chunk.stored:
                break
            leading += 1
        return leading * chunk_size

    async def pin(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Pin the prefix's complete chunks against L2 eviction; returns chunks pinned.

        The coordinator pins keys whether or not they are stored (a later store is protected
        too), so offload = :meth:`lookup` (and a touch through the engine if missing) + pin.
        Pins are counted per key: each :meth:`unpin` lowers the count by one, so pin a prefix
        once; :meth:`delete` releases all of them.
        """
        return _chunks_affected(
            await self._call(
                "POST", self._coord("/cache/pins"), self._tokens(token_ids, cache_salt)
            )
        )

    async def unpin(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Undo one :meth:`pin`; returns the prefix's complete chunks (pinned before or not)."""
        return _chunks_affected(
            await self._call(
                "DELETE", self._coord("/cache/pins"), self._tokens(token_ids, cache_salt)
            )
        )

    async def delete(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Delete the prefix's stored chunks from every tier and unpin them; returns chunks deleted."""
        return (await self.delete_prefix(token_ids, cache_salt=cache_salt)).chunks

    # -- beyond the Protocol ------------------------------------------------------------------

    async def chunks(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> list[ChunkInfo]:
        """The prefix's complete chunks, in order, with the tiers each one sits in."""
        reply = await self._call(
            "POST", self._coord("/directory/lookup"), self._tokens(token_ids, cache_salt)
        )
        return _group_chunks(reply.get("results", []))

    async def delete_prefix(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None, force: bool = False
    ) -> DeleteResult:
        """Look up the prefix's keys, ``DELETE /cache/objects`` them on each server, unpin.

        Per server holding any of them: an ``l1`` delete of the keys it has in L1, then an
        ``l2`` delete of every key it holds anywhere, since L1 is written through to L2
        asynchronously and the coordinator may not know of an L2 copy yet (L2 deletes are
        idempotent; a server without L2 answers 503, which means nothing to delete there).
        The MP server's delete ignores the coordinator's L2 pins (only the coordinator's own
        ``/cache/delete`` honours them), so an explicit evict wins over an earlier offload.
        ``force`` also deletes L1 objects locked by a transfer in flight. Keys the coordinator
        has not heard of yet (a store still in flight) are not seen: look up again to be sure.
        """
        stored = [c for c in await self.chunks(token_ids, cache_salt=cache_salt) if c.placed]
        per_server: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
        for kp in (kp for chunk in stored for kp in chunk.keys):
            for instance_id in {p.instance_id for p in kp.placements}:
                in_l1, anywhere = per_server.setdefault(instance_id, ([], []))
                anywhere.append(kp.key)
                if any(p.tier == "l1" and p.instance_id == instance_id for p in kp.placements):
                    in_l1.append(kp.key)
        urls = await self._instance_urls() if per_server else {}
        deleted, skipped = dict.fromkeys(TIERS, 0), 0
        for instance_id, (in_l1, anywhere) in per_server.items():
            # An instance the registry gives no address for (a sim that does not register, a
            # server gone since): try the configured server; keys it lacks are not counted.
            url = urls.get(instance_id, self.config.server_url.rstrip("/")) + "/cache/objects"
            for tier, keys in (("l1", in_l1), ("l2", anywhere)):
                if keys:
                    removed, refused = await self._delete_objects(url, tier, keys, force)
                    deleted[tier] += removed
                    # Only L1 refuses (locks); an L2 copy already gone is not a refusal.
                    skipped += refused if tier == "l1" else 0
        unpinned = await self._unpin_all(token_ids, cache_salt)
        # A refused key keeps (at most) one chunk alive; counts are per key, chunks per prefix.
        return DeleteResult(max(0, len(stored) - skipped), deleted, skipped, unpinned)

    async def _delete_objects(
        self, url: str, tier: str, keys: list[dict[str, Any]], force: bool
    ) -> tuple[int, int]:
        """One ``DELETE /cache/objects``: (keys deleted, keys refused as locked)."""
        try:
            reply = await self._call("DELETE", url, {"keys": keys, "tier": tier, "force": force})
        except EngineRejected as exc:
            if tier == "l2" and exc.status == 503:  # no L2 adapter on that server
                return 0, 0
            raise
        if reply.get("ok") is False:  # the L2 adapter raised; the server reports, not fails
            raise AdapterError(f"LMCache {tier} delete failed: {reply.get('error', '?')}")
        return int(reply.get("deleted", 0)), int(reply.get("skipped", 0))

    async def prefetch_to_l1(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        timeout_s: float = 30.0,
        poll_s: float = 0.2,
    ) -> int:
        """Load the prefix's chunks from L2 (disk) into the MP server's L1; returns keys found.

        Needs an engine attached to the server (it registers the KV layout; without one the
        server answers 503). Shortens the engine's later load, which then reads from memory.
        """
        reply = await self._call(
            "POST", self._server("/cache/prefetches"), self._tokens(token_ids, cache_salt)
        )
        request_id = str(reply.get("request_id", ""))
        if not request_id:  # "noop": shorter than one chunk
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            state = await self._call("GET", self._server(f"/cache/prefetches/{request_id}"))
            if state.get("status") == "completed":
                return int(state.get("found_keys", 0))
            if loop.time() >= deadline:
                raise AdapterError(f"LMCache prefetch {request_id} not done after {timeout_s}s")
            await asyncio.sleep(poll_s)

    async def pin_counts(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> dict[str, int]:
        """Active pins per chunk hash of the prefix (only pinned chunks appear)."""
        wanted = {c.chunk_hash for c in await self.chunks(token_ids, cache_salt=cache_salt)}
        salt = self.config.cache_salt if cache_salt is None else cache_salt
        counts: dict[str, int] = {}
        offset, page = 0, 10_000
        while True:  # the pin table is paged; a deployment may hold many sessions' pins
            params = {"model_name": self.config.model_name, "cache_salt": salt}
            params |= {"offset": str(offset), "limit": str(page)}
            reply = await self._call("GET", self._coord("/cache/pins"), params=params)
            pins = reply.get("pins", [])
            for pin in pins:
                chunk_hash = str(pin.get("key", {}).get("chunk_hash_hex", ""))
                if chunk_hash in wanted:
                    counts[chunk_hash] = max(
                        counts.get(chunk_hash, 0), int(pin.get("pin_count", 0))
                    )
            offset += len(pins)
            if not pins or offset >= int(reply.get("total", 0)):
                return counts

    async def _unpin_all(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Release every pin on the prefix's keys (an evict overrides earlier offloads)."""
        counts = await self.pin_counts(token_ids, cache_salt=cache_salt)
        rounds = max(counts.values(), default=0)
        for _ in range(rounds):
            await self.unpin(token_ids, cache_salt=cache_salt)
        return rounds

    async def health(self) -> bool:
        """True when both the coordinator and the MP server answer their health routes."""
        try:
            coord, server = await asyncio.gather(
                self._call("GET", self._coord("/healthz")),
                self._call("GET", self._server("/healthcheck")),
            )
        except AdapterError:
            return False
        return bool(coord.get("status") == "healthy" and server.get("status") == "healthy")

    async def l1_status(self) -> L1Status:
        """The MP server's L1 occupancy (``GET /status``), summed over its L1 managers."""
        reply = await self._call("GET", self._server("/status"))
        if self._chunk_size is None:
            self._chunk_size = int(reply.get("chunk_size") or DEFAULT_CHUNK_SIZE)
        storage: dict[str, Any] = reply.get("storage_manager", {})
        # One entry per tagged L1 (DRAM, DEVDAX...); older servers report the single manager.
        managers: list[dict[str, Any]] = list(storage.get("l1_managers", {}).values()) or [
            storage.get("l1_manager", {})
        ]
        return L1Status(
            objects=sum(int(m.get("total_object_count", 0)) for m in managers),
            used_bytes=sum(int(m.get("memory_used_bytes", 0)) for m in managers),
            total_bytes=sum(int(m.get("memory_total_bytes", 0)) for m in managers),
            chunk_size=int(reply.get("chunk_size", self.chunk_size)),
            l2_adapters=len(storage.get("l2_adapters", [])),
        )

    async def usage(self) -> list[TierUsage]:
        """Per server and tier bytes used / declared capacity (coordinator ``/instances/usage``)."""
        reply = await self._call("GET", self._coord("/instances/usage"))
        return [
            TierUsage(
                instance_id=str(inst.get("instance_id", "")),
                tier=str(mod.get("tier", "")),
                backend=str(mod.get("backend", "")),
                used_bytes=int(mod.get("used_bytes", 0)),
                capacity_bytes=int(mod.get("capacity_bytes", 0)),
            )
            for inst in reply.get("instances", [])
            for mod in inst.get("modules", [])
        ]

    async def clear_l1(self, *, force: bool = False) -> None:
        """Drop the MP server's L1 (CPU memory) contents; L2 (disk) keeps its copies."""
        await self._call("POST", self._server("/cache/clear"), {"tier": "l1", "force": force})

    async def set_quota(self, cache_salt: str, limit_gb: float) -> None:
        """Set a per-salt byte budget on the MP server."""
        await self._call("PUT", self._quota(cache_salt), {"limit_gb": limit_gb})

    async def get_quota(self, cache_salt: str) -> Quota:
        """The per-salt budget and current usage."""
        reply = await self._call("GET", self._quota(cache_salt))
        return Quota(
            cache_salt=str(reply.get("cache_salt", cache_salt)),
            limit_gb=float(reply.get("limit_gb", 0.0)),
            usage_gb=float(reply.get("current_usage_gb", 0.0)),
            exists=bool(reply.get("exists", False)),
        )

    async def delete_quota(self, cache_salt: str) -> None:
        """Remove a per-salt budget."""
        await self._call("DELETE", self._quota(cache_salt))

    # -- plumbing -----------------------------------------------------------------------------

    def _coord(self, path: str) -> str:
        return self.config.coordinator_url.rstrip("/") + path

    def _server(self, path: str) -> str:
        return self.config.server_url.rstrip("/") + path

    def _quota(self, cache_salt: str) -> str:
        return self._server(f"/quota/{quote(cache_salt, safe='')}")  # a salt is any string

    def _tokens(self, token_ids: Sequence[int], cache_salt: str | None) -> dict[str, Any]:
        return {
            "model_name": self.config.model_name,
            "world_size": self.config.world_size,
            "token_ids": list(token_ids),
            "cache_salt": self.config.cache_salt if cache_salt is None else cache_salt,
        }

    async def _instance_urls(self) -> dict[str, str]:
        """instance_id -> MP server HTTP base URL, from the coordinator's registry."""
        reply = await self._call("GET", self._coord("/instances"))
        return {
            str(i["instance_id"]): f"http://{i['ip']}:{i['http_port']}"
            for i in reply.get("instances", [])
            if "instance_id" in i and "ip" in i and "http_port" in i
        }

    async def _call(
        self,
        method: str,
        url: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        request = self._http.request(
            method,
            url,
            data=None if body is None else wire.dumps(body),
            headers=None if body is None else wire.HEADERS,
            params=params,
            timeout=self._timeout,
        )
        async with _map_errors(method, url), request as resp:
            if resp.status >= 400:
                raise EngineRejected(resp.status, _detail(await resp.text()))
            reply = wire.loads(await resp.read())
        if not isinstance(reply, dict):  # every route answers an object; anything else is drift
            raise AdapterError(f"LMCache {method} {url}: expected a JSON object, got {reply!r:.80}")
        return reply


@asynccontextmanager
async def _map_errors(method: str, url: str) -> AsyncIterator[None]:
    """The one place where transport and decoding failures become AdapterErrors."""
    try:
        yield
    except AdapterError:
        raise
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        raise EngineUnavailable(f"LMCache {method} {url}: {exc!r}") from exc
    except (aiohttp.ClientError, ValueError) as exc:  # bad payload / undecodable JSON
        raise AdapterError(f"LMCache {method} {url}: {exc!r}") from exc


def _chunks_affected(reply: dict[str, Any]) -> int:
    """Chunks a pin reply covers: ``requested`` counts chunks, ``affected`` keys (chunks x
    ranks x object groups), so report chunks, and none when no key was touched."""
    affected = int(reply.get("affected", 0))
    return min(int(reply.get("requested", affected)), affected) if affected else 0


def _detail(text: str, limit: int = 300) -> str:
    return text.strip().replace("\n", " ")[:limit]


def _placement(raw: dict[str, Any]) -> Placement:
    return Placement(
        instance_id=str(raw.get("instance_id", "")),
        tier=str(raw.get("tier", "")),
        backend=str(raw.get("backend", "")),
        size_bytes=int(raw.get("size_bytes", 0)),
    )


def _group_chunks(results: list[dict[str, Any]]) -> list[ChunkInfo]:
    """Fold the lookup's per-key results (chunks x ranks x object groups) into chunks, in order."""
    by_hash: dict[str, list[KeyPlacements]] = {}  # dicts keep first-seen (= chunk) order
    for result in results:
        key = dict(result.get("key", {}))
        placements = tuple(_placement(p) for p in result.get("placements", []))
        by_hash.setdefault(str(key.get("chunk_hash_hex", "")), []).append(
            KeyPlacements(key, placements)
        )
    return [
        ChunkInfo(index=i, chunk_hash=h, keys=tuple(kps))
        for i, (h, kps) in enumerate(by_hash.items())
    ]
