"""Protected sessions the GPU is losing, held in the engine's offload tier instead.

An LMCache tier behind the engine is written through (every prefill is stored) and evicts by
LRU; it does not know which contexts will be back. kvkeeper does: the sessions retention
protects (a tool call outstanding, a TTL). Retention keeps them on the GPU with keep-alive
touches while their GPU protection fits its budget; when the GPU begins to lose one anyway
(KV events show its prefix no longer whole: a pressure override, a touch too late), the keeper
pins its recorded context in the tier while the tier still holds it, chosen by
:func:`policy.tier_pins.plan_pins` within ``retention.tier_pin_share`` of the tier's capacity
(read from the MP server's ``/status``). The rest of the tier stays LRU. A session whose whole
prefix (its complete chunks) is stored and pinned is *held by the tier*: its resume loads the
prefix (over PCIe from CPU memory, about a tenth of a re-prefill's cost on the h100 profile)
instead of recomputing it, so retention sends it no touches. Without KV events residency is
unknown and every protected session is a candidate.

LMCache counts pins per chunk key, so each session version is pinned once and released when the
session records a new context (its resume: resident again), when its protection ends, or when it
falls out of the share; a new version pinned replaces the old one after it, so the chunks both
cover never drop to zero. On the LMCache MP stack the coordinator's pins protect the L2 copy
(L1 stays LRU), so a held session may load from L2.

Agent anchors (``retention.tier_pin_anchors``, learned by :mod:`proxy.anchors`) are pinned
within the same share, ordered with the sessions by expected next use; an anchor is a candidate
while a live session may call its agent, whether or not the GPU still holds it (a GPU hit does not refresh the tier's
copy, so it would age out there first), and pinned again when it is relearned. Its pins take
the ledger's key ``(tenant, ANCHOR_MARK + agent)``, which no session id can take (ids carry no
control characters).

LMCache pins have no TTL, so every pin is also recorded in Redis (``tierpins:<engine>``, the
pinned tokens and version) until it is released: the replica that takes over an engine's
retention lease (after a crash, or a lost lease) adopts them and releases them as its own, and
a replica that loses the lease leaves them to it. :meth:`TierKeeper.release` on a clean stop
undoes them. A tier that does not answer leaves sessions to the touches, as without a tier.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from adapters.base import AdapterError
from adapters.lmcache import LMCacheAdapter
from adapters.vllm import CHAT_ROUTE, COMPLETION_ROUTE
from policy import PinCandidate, plan_pins
from proxy.anchors import AnchorPin
from proxy.context import decode_context
from proxy.metrics import Metrics
from proxy.settings import RetentionSettings
from proxy.store import Session, SessionStore, StoreDown

if TYPE_CHECKING:
    from proxy.retention import EngineState

log = logging.getLogger("kvkeeper.tiers")

SessionKey = tuple[str, str]
ANCHOR_MARK = "\x1eanchor\x1e"  # an anchor's key in the pins: (tenant, ANCHOR_MARK + agent)
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
    return json.dumps(head).encode() + b"\n" + array("I", pin.tokens).tobytes()


def decode_pin(raw: bytes) -> _Pin | None:
    """The pin ``encode_pin`` wrote; None for a record it cannot read."""
    head, _, body = raw.partition(b"\n")
    try:
        meta = json.loads(head)
        tokens = array("I")
        tokens.frombytes(body[: len(body) - len(body) % tokens.itemsize])
        salt = meta["salt"]
        return _Pin(
            float(meta["version"]),
            tokens.tolist(),
            salt if isinstance(salt, str) else None,
            int(meta["chunks"]),
            int(meta["stored"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(slots=True)
class _TierState:
    pins: dict[SessionKey, _Pin] = field(default_factory=dict)
    # session -> (last_used of the version looked up, whether the tier stored all of it)
    stored: dict[SessionKey, tuple[float, bool]] = field(default_factory=dict)
    capacity_chunks: int | None = None
    capacity_at: float = -math.inf


class TierKeeper:
    """Pins protected sessions in each engine's offload tier (module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        settings: RetentionSettings,
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

    async def tick(
        self,
        es: EngineState,
        sessions: Sequence[Session],
        blocks: dict[SessionKey, tuple[int, ...]],
        now: float,
        anchors: Sequence[AnchorPin] = (),
    ) -> set[SessionKey]:
        """Pin what fits, unpin what left; the sessions the tier now holds (no touches)."""
        tier = es.tier
        if tier is None:
            return set()
        st = self._state.setdefault(es.engine.name, _TierState())
        if self.settings.tier_pin_share <= 0:  # off; pins adopted from a ledger still go
            for sk in list(st.pins):
                await self._release_pin(es, tier, sk, st.pins.pop(sk))
            return set()
        by_key = {(s.tenant, s.session_id): s for s in sessions}
        capacity = await self._capacity(tier, st, now)
        if capacity is not None:
            chunk = tier.config.chunk_size
            bs = es.adapter.cache.block_size
            by_anchor = {(a.tenant, ANCHOR_MARK + a.agent): a for a in anchors}
            anchor_keep = self.settings.tier_anchor_keep_factor
            due = [  # (key, chunks, next use, keep factor)
                (sk, len(blocks.get(sk, ())) * bs // chunk, s.ttl_left(now), 1.0)
                for sk, s in by_key.items()
                if self._candidate(es, st, s, blocks.get(sk, ()))
            ] + [
                (sk, len(a.tokens) // chunk, a.next_use_s, anchor_keep)
                for sk, a in by_anchor.items()
            ]
            names = {f"{sk[0]}\x1f{sk[1]}": sk for sk, *_ in due}
            wanted = plan_pins(
                [
                    PinCandidate(f"{sk[0]}\x1f{sk[1]}", n, t, sk in st.pins, k)
                    for sk, n, t, k in due
                ],
                capacity,
                self.settings.tier_pin_share,
            )
            want = [names[n] for n in wanted]
            keep = set(want)
            for sk in [sk for sk in st.pins if sk not in keep]:
                await self._release_pin(es, tier, sk, st.pins.pop(sk))
            await self._pin_wanted(es, tier, st, want, by_key, by_anchor)
        self._report(es, st)
        return {
            sk
            for sk, pin in st.pins.items()
            if sk in by_key
            and pin.version == by_key[sk].last_used
            and pin.chunks > 0
            and pin.stored >= pin.chunks * tier.config.chunk_size
        }

    async def covered(
        self, es: EngineState, sessions: Sequence[Session], now: float
    ) -> set[SessionKey]:
        """Protected sessions the tier will still hold when their protection ends: it stores
        their whole context, and the tokens the engine computes (the new content a
        written-through tier takes in) from their last request to the end of their protection,
        at the current rate, stay within ``safety_fraction`` of the tier's capacity. A resume
        loads such a context; GPU touches would only take scheduler slots
        (``retention.tier_skip_touches``)."""
        tier = es.tier
        rate = es.computed_rate
        if not self.settings.tier_skip_touches or tier is None or rate is None:
            return set()
        st = self._state.setdefault(es.engine.name, _TierState())
        capacity = await self._capacity(tier, st, now)
        if capacity is None:
            return set()
        room = self.settings.safety_fraction * capacity * tier.config.chunk_size
        out: set[SessionKey] = set()
        checks = 0
        for s in sessions:
            sk = (s.tenant, s.session_id)
            if rate * max(0.0, s.ttl_until - s.last_used) > room:
                continue
            known = st.stored.get(sk)
            if known is None or known[0] != s.last_used:
                if checks >= self.max_pins_per_tick:
                    continue
                checks += 1
                known = st.stored[sk] = (s.last_used, await self._stored_in_full(es, tier, s))
            if known[1]:
                out.add(sk)
        live = {(s.tenant, s.session_id) for s in sessions}
        st.stored = {sk: v for sk, v in st.stored.items() if sk in live}
        return out

    async def release(self, es: EngineState) -> None:
        """Undo every pin this keeper holds on ``es``'s tier (a clean stop)."""
        st = self._state.pop(es.engine.name, None)
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
            ledger = await self.store.tier_pins(es.engine.name)
        except StoreDown:
            return 0
        st = self._state.setdefault(es.engine.name, _TierState())
        adopted = 0
        for sk, raw in ledger.items():
            pin = decode_pin(raw)
            if pin is None or sk in st.pins:
                continue
            st.pins[sk] = pin
            adopted += 1
        if adopted:
            log.info("tier pins: adopted %d sessions' pins on %s", adopted, es.engine.name)
        self._report(es, st)
        return adopted

    def abandon(self, es: EngineState) -> None:
        """This replica no longer drives ``es``: forget its pins without undoing them (the
        ledger hands them to the replica that does)."""
        st = self._state.pop(es.engine.name, None)
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
        pin = st.pins.get((session.tenant, session.session_id))
        if pin is not None and pin.version == session.last_used:
            return True
        if es.subscriber is None or not blocks:
            return True  # residency unknown: every protected session
        return es.index.resident_prefix(blocks) < len(blocks)

    async def _pin_wanted(
        self,
        es: EngineState,
        tier: LMCacheAdapter,
        st: _TierState,
        want: list[SessionKey],
        sessions: dict[SessionKey, Session],
        anchors: dict[SessionKey, AnchorPin],
    ) -> None:
        """Pin the current version of each wanted session's context or anchor (at most
        ``max_pins_per_tick``)."""
        changes = 0
        for sk in want:
            session, anchor = sessions.get(sk), anchors.get(sk)
            version = session.last_used if session is not None else anchor.version if anchor else 0
            old = st.pins.get(sk)
            if old is not None and old.version == version:
                continue
            if changes >= self.max_pins_per_tick:
                break
            changes += 1
            found = await self._pin_source(es, session, anchor)
            pin = None if found is None else await self._pin(tier, sk, version, *found)
            if pin is None:
                continue
            log.debug(
                "tier pin: %s on %s, %d chunks (%d tokens stored)",
                f"anchor {sk[1][len(ANCHOR_MARK) :]}" if is_anchor(sk) else sk[1],
                es.engine.name,
                pin.chunks,
                pin.stored,
            )
            st.pins[sk] = pin
            await self._record(es, sk, pin)
            if old is not None:  # after the new pin: the chunks both cover never drop to zero
                await self._unpin(tier, old)
            elif session is not None:
                self.metrics.offloads.inc()

    async def _pin_source(
        self, es: EngineState, session: Session | None, anchor: AnchorPin | None
    ) -> tuple[list[int], str | None] | None:
        """The token ids and cache salt to pin: the anchor's, or the session's recorded
        context (None when it has none the tier can key, or it could not be read)."""
        if anchor is not None:
            return anchor.tokens, anchor.cache_salt
        if session is None:
            return None
        try:
            return await self._context(es, session)
        except StoreDown:
            return None
        except _TIER_ERRORS as exc:
            log.warning("tier pin of %s failed: %s", session.session_id, exc)
            return None

    async def _context(
        self, es: EngineState, session: Session
    ) -> tuple[list[int], str | None] | None:
        """The token ids and cache salt of the session's recorded context (None: none the tier
        can key)."""
        if es.no_tokenize:
            return None
        blob = await self.store.get_context(session.tenant, session.session_id)
        if blob is None:
            return None
        ctx = decode_context(blob)
        if ctx.route not in (CHAT_ROUTE, COMPLETION_ROUTE):
            return None  # /v1/messages, /v1/responses: no tokenizer route to key them
        tokens = await es.adapter.tokenize(ctx.route, ctx.prefix_body())
        if ctx.block_offset is not None:
            tokens = tokens[: ctx.block_offset * es.adapter.cache.block_size]
        salt = ctx.body.get("cache_salt")
        return tokens, salt if isinstance(salt, str) else None

    @staticmethod
    async def _pin(
        tier: LMCacheAdapter, sk: SessionKey, version: float, tokens: list[int], salt: str | None
    ) -> _Pin | None:
        """Pin ``tokens`` (a session's recorded context, an anchor); None when the tier failed."""
        try:
            await tier.pin(tokens, cache_salt=salt)
        except _TIER_ERRORS as exc:
            log.warning("tier pin of %s failed: %s", sk[1], exc)
            return None
        pin = _Pin(version, tokens, salt, len(tokens) // tier.config.chunk_size, 0)
        try:
            pin.stored = await tier.lookup(tokens, cache_salt=salt)
        except _TIER_ERRORS as exc:  # pinned, but not known to be stored: touches go on
            log.warning("tier lookup of %s failed: %s", sk[1], exc)
        return pin

    async def _stored_in_full(
        self, es: EngineState, tier: LMCacheAdapter, session: Session
    ) -> bool:
        """Whether the tier stores every complete chunk of the session's recorded context."""
        try:
            found = await self._context(es, session)
            if found is None:
                return False
            tokens, salt = found
            want = len(tokens) // tier.config.chunk_size * tier.config.chunk_size
            return want > 0 and await tier.lookup(tokens, cache_salt=salt) >= want
        except StoreDown:
            return False
        except _TIER_ERRORS as exc:
            log.warning("tier lookup of %s failed: %s", session.session_id, exc)
            return False

    async def _record(self, es: EngineState, sk: SessionKey, pin: _Pin) -> None:
        """Write the pin to the ledger (replacing the session's previous version)."""
        try:
            await self.store.save_tier_pin(es.engine.name, *sk, encode_pin(pin))
        except StoreDown:  # held here all the same; only a crash before the next write loses it
            log.warning("tier pin of %s not recorded: Redis unavailable", sk[1])

    async def _release_pin(
        self, es: EngineState, tier: LMCacheAdapter, sk: SessionKey, pin: _Pin
    ) -> None:
        await self._unpin(tier, pin)
        with contextlib.suppress(StoreDown):
            await self.store.drop_tier_pin(es.engine.name, *sk)

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
        self.metrics.tier_pinned_sessions.labels(es.engine.name).set(counts["sessions"])
        self.metrics.tier_pinned_anchors.labels(es.engine.name).set(counts["anchors"])
        self.metrics.tier_pinned_chunks.labels(es.engine.name).set(counts["chunks"])


def is_anchor(sk: SessionKey) -> bool:
    """Whether a pin key is an agent anchor's, not a session's."""
    return sk[1].startswith(ANCHOR_MARK)


def _counts(st: _TierState | None) -> dict[str, int]:
    """Sessions, anchors and chunks pinned (none without a state)."""
    pins = st.pins if st is not None else {}
    anchors = sum(1 for sk in pins if is_anchor(sk))
    return {
        "sessions": len(pins) - anchors,
        "anchors": anchors,
        "chunks": sum(p.chunks for p in pins.values()),
    }
