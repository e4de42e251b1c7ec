"""Retention beyond what the GPU should hold, kept in the engine's offload tier.

A request that asks for more than ``limits.max_ttl_s`` (``prompt_cache_retention: "24h"``, or a
TTL over the cap) keeps GPU protection up to the cap, as any other; the rest is realized in the
offload tier: once the request's context is recorded, kvkeeper pins the session's prefix there
(LMCache MP: the coordinator's pins keep the L2 / disk copy from eviction) until the asked-for
retention ends (``limits.max_retain_s`` at most). The next request of the session pins its
longer context and then releases the older one, so the chunks both cover stay pinned throughout.

LMCache pins have no TTL, so each pin is recorded in Redis (``long:dl`` deadlines, ``long:pins``
the pinned tokens): every replica sweeps the deadlines, and one atomic claim per pin makes
exactly one of them release it, after a restart or a lease takeover as well. Freeing the session
(an ``evict`` edit, ``DELETE /admin/sessions/...``) releases it at once. A released context is
no longer protected in the tier: the tier's LRU drops it when it needs the room. On resume the
engine's connector loads the context back from the tier; a ``prefetch`` edit stages it ahead
(:mod:`proxy.operations`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from adapters.base import AdapterError
from proxy.metrics import Metrics
from proxy.store import StoreDown
from proxy.store_pins import pack_pin, unpack_pin
from proxy.tiers import context_tokens

if TYPE_CHECKING:
    from proxy.engine_state import EngineState
    from proxy.store import SessionStore

log = logging.getLogger("kvkeeper.longterm")

_TIER_ERRORS = (AdapterError, aiohttp.ClientError, TimeoutError, ValueError, KeyError)


@dataclass(slots=True)
class LongPin:
    """A long-retention pin: where, what to unpin later, and what the tier held when pinned."""

    engine: str
    tokens: list[int]
    salt: str | None
    chunks: int  # complete chunks of ``tokens``
    stored: int = 0  # leading tokens the tier held right after pinning


def encode_long_pin(pin: LongPin) -> bytes:
    """A JSON header line, then the tokens as uint32 (as the tier-pin ledger stores them)."""
    head = {"engine": pin.engine, "salt": pin.salt, "chunks": pin.chunks, "stored": pin.stored}
    return pack_pin(head, pin.tokens)


def decode_long_pin(raw: bytes) -> LongPin | None:
    """The pin ``encode_long_pin`` wrote; None for a record it cannot read."""
    try:
        meta, tokens = unpack_pin(raw)
        salt = meta["salt"]
        return LongPin(
            str(meta["engine"]),
            tokens,
            salt if isinstance(salt, str) else None,
            int(meta["chunks"]),
            int(meta["stored"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


class LongRetention:
    """Pins long-retained sessions in their engine's offload tier (module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        engines: Mapping[str, EngineState],
        metrics: Metrics,
        *,
        sweep_s: float = 5.0,
    ) -> None:
        self.store = store
        self.engines = engines
        self.metrics = metrics
        self.sweep_s = sweep_s
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    async def retain(self, tenant: str, sid: str, engine: str, retain_s: float) -> str:
        """Pin the session's recorded context in ``engine``'s tier until ``retain_s`` from now;
        the outcome (also counted in ``kvkeeper_long_retention_total``)."""
        key = (tenant, sid)
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:  # one session's versions are pinned and released in order
                outcome = await self._retain(tenant, sid, engine, time.time() + retain_s)
        finally:
            lock, users = self._locks[key]
            if users > 1:
                self._locks[key] = (lock, users - 1)
            else:
                del self._locks[key]
        self.metrics.long_retention.labels(outcome).inc()
        return outcome

    async def _retain(self, tenant: str, sid: str, engine: str, until: float) -> str:
        es = self.engines.get(engine)
        if es is None or es.tier is None:
            return "no_offload_tier"
        try:
            found = await context_tokens(self.store, es, tenant, sid)
            if found is None:
                return "no_recorded_context"
            tokens, salt = found
            chunk = await es.tier.chunk_tokens()
            if len(tokens) < chunk:
                return "shorter_than_a_chunk"
            old = await self.store.long_pin(tenant, sid)
            previous = decode_long_pin(old[1]) if old is not None else None
            if previous is not None and (previous.engine, previous.tokens) == (engine, tokens):
                await self.store.save_long_pin(tenant, sid, until, encode_long_pin(previous))
                return "extended"
            await es.tier.pin(tokens, cache_salt=salt)
            pin = LongPin(engine, tokens, salt, len(tokens) // chunk)
            with contextlib.suppress(*_TIER_ERRORS):
                pin.stored = await es.tier.lookup(tokens, cache_salt=salt)
            await self.store.save_long_pin(tenant, sid, until, encode_long_pin(pin))
        except StoreDown:
            return "store_unavailable"
        except _TIER_ERRORS as exc:
            log.warning("long retention of %s failed: %s", sid, exc)
            return "failed"
        if previous is not None:  # after the new pin: chunks both versions cover stay pinned
            await self._unpin(previous)
        return "pinned"

    async def release(self, tenant: str, sid: str) -> bool:
        """The session was freed: release its pin now (True when it had one)."""
        try:
            raw = await self.store.claim_long_pin(tenant, sid)
        except StoreDown:
            return False
        if raw is None:
            return False
        pin = decode_long_pin(raw)
        if pin is not None:
            await self._unpin(pin)
        self.metrics.long_retention.labels("released_freed").inc()
        return True

    async def sweep(self, now: float | None = None) -> int:
        """Release every pin whose retention has ended; how many this replica released."""
        now = time.time() if now is None else now
        released = 0
        try:
            due = await self.store.long_pins_due(now)
            for tenant, sid in due:
                raw = await self.store.claim_long_pin(tenant, sid, before=now)
                if raw is None:  # another replica took it, or the session renewed it
                    continue
                pin = decode_long_pin(raw)
                if pin is not None:
                    await self._unpin(pin)
                released += 1
                self.metrics.long_retention.labels("released_expired").inc()
        except StoreDown:
            pass
        return released

    async def run(self) -> None:
        """Sweep every ``sweep_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                await self.sweep()
            except Exception:  # a bad record must not stop the sweeps
                log.exception("long retention sweep failed")

    # --- internals ------------------------------------------------------------------------------
    async def _unpin(self, pin: LongPin) -> None:
        es = self.engines.get(pin.engine)
        if es is None or es.tier is None:
            log.warning(
                "long retention: no tier on %s, %d chunks stay pinned", pin.engine, pin.chunks
            )
            return
        try:
            await es.tier.unpin(pin.tokens, cache_salt=pin.salt)
        except _TIER_ERRORS as exc:
            log.warning("long retention unpin failed (%d chunks stay pinned): %s", pin.chunks, exc)
