"""Protected sessions the GPU is losing, held in the engine's offload tier instead.

An LMCache tier behind the engine is written through (every prefill is stored) and evicts by
LRU; it does not know which contexts will be back. kvkeeper does: the sessions retention
protects (a tool call outstanding, a TTL). Retention keeps them on the GPU with keep-alive
touches while their GPU protection fits its budget; when the GPU begins to lose one anyway
(KV events show its prefix no longer whole: a pressure override, a touch too late), the keeper
pins its recorded context in the tier while the tier still holds it, chosen by
:func:`policy.tier_pins.plan_pins` within ``tier.pin_share`` of the tier's capacity
(read from the MP server's ``/status``). The rest of the tier stays LRU. A session whose whole
prefix (its complete chunks) is stored and pinned is *held by the tier*: its resume loads the
prefix (over PCIe from CPU memory, far cheaper than a re-prefill)
instead of recomputing it, so retention sends it no touches. Without KV events residency is
unknown and every protected session is a candidate.

LMCache counts pins per chunk key, so each session version is pinned once and released when the
session records a new context (its resume: resident again), when its protection ends, or when it
falls out of the share; a new version pinned replaces the old one after it, so the chunks both
cover never drop to zero. On the LMCache MP stack the coordinator's pins protect the L2 copy
(L1 stays LRU), so a held session may load from L2.

LMCache pins have no TTL, so every pin is also recorded in Redis (``tierpins:<engine>``, the
pinned tokens and version) until it is released: the replica that takes over an engine's
retention lease (after a crash, or a lost lease) adopts them and releases them as its own, and
a replica that loses the lease leaves them to it. :meth:`TierKeeper.release` on a clean stop
undoes them. A tier that does not answer leaves sessions to the touches, as without a tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from adapters.base import AdapterError
from adapters.lmcache import LMCacheAdapter
from policy import PinCandidate, plan_pins
from proxy.context import decode_context
from proxy.context_cache import ContextCache
from proxy.engine_state import EngineState
from proxy.guards import Guards
from proxy.keys import SessionKey
from proxy.metrics import Metrics
from proxy.settings import TierSettings
from proxy.store import Session, SessionStore, StoreDown
from proxy.store_pins import pack_pin, unpack_pin

log = logging.getLogger("kvkeeper.tiers")

_TIER_ERRORS = (AdapterError, aiohttp.ClientError, TimeoutError, ValueError, KeyError)


@dataclass(slots=True)
class _Pin:
    """One session version pinned in the tier: what to unpin later."""

    version: float  # the session's last_used when its context was pinned
    tokens: list[int]
    salt: str | None
    chunks: int  # complete chunks of ``tokens``
    stored: int  # leading tokens the tier held right after pinning


def encode_pin(pin: _Pin) -> bytes:
    """A pin as the ledger stores it: a JSON header line, then the tokens as uint32."""
    head = {"version": pin.version, "salt": pin.salt, "chunks": pin.chunks, "stored": pin.stored}
    return pack_pin(head, pin.tokens)


def decode_pin(raw: bytes) -> _Pin | None:
    """The pin ``encode_pin`` wrote; None for a record it cannot read."""
    try:
        meta, tokens = unpack_pin(raw)
        salt = meta["salt"]
        return _Pin(
            float(meta["version"]),
            tokens,
            salt if isinstance(salt, str) else None,
            int(meta["chunks"]),
            int(meta["stored"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


async def context_tokens(
    store: SessionStore,
    es: EngineState,
    tenant: str,
    sid: str,
    contexts: ContextCache | None = None,
) -> tuple[list[int], str | None] | None:
    """The token ids and cache salt of the session's recorded context (None: none a tier can
    key); ``contexts``: decoded and tokenized once per context version."""
    if es.no_tokenize:
        return None
    blob = await store.get_context(tenant, sid)
    if blob is None:
        return None
    if contexts is not None:
        key = SessionKey(tenant, sid)
        view = await contexts.view(key, blob)
        ctx = view.ctx
        if not es.adapter.tokenizable(ctx.route):
            return None
        tokens = await contexts.tokens(key, view, es, prefix=True)
    else:
        await asyncio.sleep(0)  # between the read and decoding it, the loop's other work
        ctx = decode_context(blob)
        if not es.adapter.tokenizable(ctx.route):
            return None  # /v1/messages, /v1/responses: no tokenizer route to key them
        tokens = await es.adapter.tokenize(ctx.route, ctx.prefix_body())
    if ctx.block_offset is not None:
        tokens = tokens[: ctx.block_offset * es.signals.block_size]
    salt = ctx.body.get("cache_salt")
    return tokens, salt if isinstance(salt, str) else None


@dataclass(slots=True)
class _TierState:
    pins: dict[SessionKey, _Pin] = field(default_factory=dict)
    capacity_chunks: int | None = None
    capacity_at: float = -math.inf


class TierKeeper:
    """Pins protected sessions in each engine's offload tier (module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        settings: TierSettings,
        metrics: Metrics,
        *,
        max_pins_per_tick: int = 8,
        capacity_refresh_s: float = 10.0,
        capacity_retry_s: float = 1.0,
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.max_pins_per_tick = max_pins_per_tick
        self.capacity_refresh_s = capacity_refresh_s
        self.capacity_retry_s = capacity_retry_s
        self._state: dict[str, _TierState] = {}
        self.guards: Guards | None = None  # set by Retention: no new pins while it backs off
        self.contexts: ContextCache | None = None  # set by Retention: shared with block learning

    async def tick(
        self,
        es: EngineState,
        sessions: Sequence[Session],
        blocks: dict[SessionKey, tuple[int, ...]],
        now: float,
    ) -> set[SessionKey]:
        """Pin what fits, unpin what left; the sessions the tier now holds (no touches)."""
        tier = es.tier
        if tier is None:
            return set()
        st = self._state.setdefault(es.name, _TierState())
        if self.settings.pin_share <= 0:  # off; pins adopted from a ledger still go
            for sk in list(st.pins):
                await self._release_pin(es, tier, sk, st.pins.pop(sk))
            return set()
        by_key = {SessionKey(s.tenant, s.session_id): s for s in sessions}
        # long retention pins those sessions for their lifetime already: no second pin
        with contextlib.suppress(StoreDown):
            for tenant, sid in await self.store.long_held(list(by_key)):
                del by_key[SessionKey(tenant, sid)]
        capacity = await self._capacity(tier, st, now)
        if capacity is not None:
            chunk = tier.chunk_size
            bs = es.signals.block_size
            candidates = [
                PinCandidate(
                    sk,
                    len(blocks.get(sk, ())) * bs // chunk,
                    s.ttl_left(now),
                    sk in st.pins,
                    s.guessed,
                )
                for sk, s in by_key.items()
                if self._candidate(es, st, s, blocks.get(sk, ()))
            ]
            want = [
                SessionKey(*k) for k in plan_pins(candidates, capacity, self.settings.pin_share)
            ]
            keep = set(want)
            for sk in [sk for sk in st.pins if sk not in keep]:
                await self._release_pin(es, tier, sk, st.pins.pop(sk))
            if self.guards is None or self.guards.allows(es.name, now):
                await self._pin_wanted(es, tier, st, want, by_key)
        self._report(es, st)
        return {
            sk
            for sk, pin in st.pins.items()
            if sk in by_key
            and pin.version == by_key[sk].last_used
            and pin.chunks > 0
            and pin.stored >= pin.chunks * tier.chunk_size
        }

    async def release(self, es: EngineState) -> None:
        """Undo every pin this keeper holds on ``es``'s tier (a clean stop)."""
        st = self._state.pop(es.name, None)
        if st is None or es.tier is None:
            return
        for sk, pin in st.pins.items():
            await self._release_pin(es, es.tier, sk, pin)
        st.pins.clear()
        self._report(es, st)

    async def adopt(self, es: EngineState) -> int:
        """This replica now drives ``es``: take over the pins the ledger records for it (left
        by a replica that crashed or lost the lease); how many."""
        if es.tier is None:
            return 0
        try:
            ledger = await self.store.tier_pins(es.name)
        except StoreDown:
            return 0
        st = self._state.setdefault(es.name, _TierState())
        adopted = 0
        for sk, raw in ledger.items():
            pin = decode_pin(raw)
            if pin is None or sk in st.pins:
                continue
            st.pins[SessionKey(*sk)] = pin
            adopted += 1
        if adopted:
            log.info("tier pins: adopted %d sessions' pins on %s", adopted, es.name)
        self._report(es, st)
        return adopted

    def abandon(self, es: EngineState) -> None:
        """This replica no longer drives ``es``: forget its pins without undoing them (the
        ledger hands them to the replica that does)."""
        st = self._state.pop(es.name, None)
        if st is not None:
            st.pins.clear()
            self._report(es, st)

    def pinned(self, engine: str) -> dict[str, int | None]:
        """``{"sessions": n, "chunks": m, "capacity_chunks": c}`` on ``engine``'s tier (views):
        what is pinned, and the capacity the share applies to (None until the tier stored
        something to measure it by)."""
        st = self._state.get(engine)
        return {**_counts(st), "capacity_chunks": st.capacity_chunks if st is not None else None}

    # --- internals ------------------------------------------------------------------------------
    @staticmethod
    def _candidate(
        es: EngineState, st: _TierState, session: Session, blocks: tuple[int, ...]
    ) -> bool:
        """Worth a pin: the GPU has begun to lose the session's prefix (with KV events; a
        resident one is kept by touches, and the tier's LRU keeps its chunks as long), or its
        current version is pinned already (kept until it records a new one)."""
        pin = st.pins.get(SessionKey(session.tenant, session.session_id))
        if pin is not None and pin.version == session.last_used:
            return True
        resident = es.signals.resident(blocks)
        return resident is None or resident < len(blocks)  # None: unknown, every session

    async def _pin_wanted(
        self,
        es: EngineState,
        tier: LMCacheAdapter,
        st: _TierState,
        want: list[SessionKey],
        sessions: dict[SessionKey, Session],
    ) -> None:
        """Pin the current version of each wanted session's context (at most
        ``max_pins_per_tick``)."""
        changes = 0
        for sk in want:
            await asyncio.sleep(0)  # one pin's lookup and encoding at a time on the shared loop
            session = sessions[sk]
            old = st.pins.get(sk)
            if old is not None and old.version == session.last_used:
                continue
            if changes >= self.max_pins_per_tick:
                break
            changes += 1
            found = await self._pin_source(es, session)
            pin = None if found is None else await self._pin(tier, sk, session.last_used, *found)
            if pin is None:
                continue
            log.debug(
                "tier pin: %s on %s, %d chunks (%d tokens stored)",
                sk.session_id,
                es.name,
                pin.chunks,
                pin.stored,
            )
            st.pins[sk] = pin
            if self.guards is not None:  # a resume loads what the pin holds
                self.guards.kept(es.name, sk, pin.stored, tier=True)
            await self._record(es, sk, pin)
            if old is not None:  # after the new pin: the chunks both cover never drop to zero
                await self._unpin(tier, old)
            else:
                self.metrics.offloads.inc()

    async def _pin_source(
        self, es: EngineState, session: Session
    ) -> tuple[list[int], str | None] | None:
        """The token ids and cache salt of the session's recorded context (None when it has
        none the tier can key, or it could not be read)."""
        try:
            sid = session.session_id
            return await context_tokens(self.store, es, session.tenant, sid, self.contexts)
        except StoreDown:
            return None
        except _TIER_ERRORS as exc:
            log.warning("tier pin of %s failed: %s", session.session_id, exc)
            return None

    @staticmethod
    async def _pin(
        tier: LMCacheAdapter, sk: SessionKey, version: float, tokens: list[int], salt: str | None
    ) -> _Pin | None:
        """Pin ``tokens`` (a session's recorded context, an anchor); None when the tier failed."""
        try:
            await tier.pin(tokens, cache_salt=salt)
            chunk = await tier.chunk_tokens()
        except _TIER_ERRORS as exc:
            log.warning("tier pin of %s failed: %s", sk[1], exc)
            return None
        pin = _Pin(version, tokens, salt, len(tokens) // chunk, 0)
        try:
            pin.stored = await tier.lookup(tokens, cache_salt=salt)
        except _TIER_ERRORS as exc:  # pinned, but not known to be stored: touches go on
            log.warning("tier lookup of %s failed: %s", sk[1], exc)
        return pin

    async def _record(self, es: EngineState, sk: SessionKey, pin: _Pin) -> None:
        """Write the pin to the ledger (replacing the session's previous version)."""
        try:
            await self.store.save_tier_pin(es.name, *sk, encode_pin(pin))
        except StoreDown:  # held here all the same; only a crash before the next write loses it
            log.warning("tier pin of %s not recorded: Redis unavailable", sk[1])

    async def _release_pin(
        self, es: EngineState, tier: LMCacheAdapter, sk: SessionKey, pin: _Pin
    ) -> None:
        await self._unpin(tier, pin)
        with contextlib.suppress(StoreDown):
            await self.store.drop_tier_pin(es.name, *sk)

    @staticmethod
    async def _unpin(tier: LMCacheAdapter, pin: _Pin) -> None:
        try:
            await tier.unpin(pin.tokens, cache_salt=pin.salt)
        except _TIER_ERRORS as exc:  # the pin stays on the tier: logged, not retried
            log.warning("tier unpin failed (%d chunks stay pinned): %s", pin.chunks, exc)

    async def _capacity(self, tier: LMCacheAdapter, st: _TierState, now: float) -> int | None:
        """The tier's capacity in chunks (its L1 total over the bytes of one stored object),
        refreshed every ``capacity_refresh_s``; None until the tier has stored something, asked
        again every ``capacity_retry_s`` until then."""
        every = self.capacity_refresh_s if st.capacity_chunks is not None else self.capacity_retry_s
        if now - st.capacity_at < every:
            return st.capacity_chunks
        st.capacity_at = now
        try:
            status = await tier.l1_status()
        except _TIER_ERRORS as exc:
            log.warning("tier status failed: %s", exc)
            return st.capacity_chunks
        if status.objects > 0 and status.used_bytes > 0:
            st.capacity_chunks = int(status.total_bytes * status.objects // status.used_bytes)
            log.debug("tier capacity: %d chunks (%s)", st.capacity_chunks, status)
        else:
            log.debug("tier capacity unknown: its L1 holds nothing yet (%s)", status)
        return st.capacity_chunks

    def _report(self, es: EngineState, st: _TierState) -> None:
        counts = _counts(st)
        self.metrics.tier_pinned_sessions.labels(es.name).set(counts["sessions"])
        self.metrics.tier_pinned_chunks.labels(es.name).set(counts["chunks"])


def _counts(st: _TierState | None) -> dict[str, int]:
    """Sessions and chunks pinned (none without a state)."""
    pins = st.pins if st is not None else {}
    return {"sessions": len(pins), "chunks": sum(p.chunks for p in pins.values())}
