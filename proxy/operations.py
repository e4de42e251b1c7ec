"""The RFC's context edits realized from outside the engine, and the admin per-session operations.

* ``evict``: stop protecting (TTL 0), forget the engine affinity (dead for routing), delete the
  session's chunks from the offload tier except the prefix it shares with a live relative.
* ``offload``: needs an offload tier (else ``unsupported``): make sure the prefix is stored there
  (lookup; one touch stores it through the connector if not), pin it, then release GPU protection.
* ``prefetch``: with a tier, stage the chunks into its memory tier; then a warm-up request on the
  engine that will serve the resume (loads the prefix from the tier, or recomputes it).
* ``pin`` (admin): protect for a TTL, and pin the prefix in the tier when there is one.

Block ranges are session-relative logical blocks of the engine's block size (RFC ``block_start``,
``block_end``, half-open); they must lie within the session's recorded blocks.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from adapters.base import AdapterError, TouchResult
from policy.prefix_index import common_prefix
from proxy.context import decode_context
from proxy.edits import EditResult
from proxy.engine_state import EngineState
from proxy.hint_model import Edit
from proxy.keys import SessionKey
from proxy.longterm import LongRetention
from proxy.metrics import Metrics
from proxy.retention import Retention
from proxy.store import Session, SessionStore, StoreDown

# a warm-up that would re-prefill more than this share of the pool is declined
PREFETCH_MAX_POOL_SHARE = 0.25


class SessionOps:
    """Implements :class:`proxy.edits.EditExecutor` on top of the retention layer."""

    def __init__(
        self, store: SessionStore, retention: Retention, metrics: Metrics, max_ttl_s: float
    ) -> None:
        self.store = store
        self.retention = retention
        self.metrics = metrics
        self.max_ttl_s = max_ttl_s
        self.longterm: LongRetention | None = None  # set when an engine has an offload tier

    async def apply(
        self, tenant: str, session_id: str, edits: tuple[Edit, ...]
    ) -> list[EditResult]:
        results = []
        for edit in edits:
            try:
                result = await self.run(tenant, session_id, edit)
            except (AdapterError, StoreDown) as exc:
                result = EditResult(edit, "failed", type(exc).__name__, {"error": str(exc)[:200]})
            results.append(result)
        return results

    async def run(
        self, tenant: str, sid: str, edit: Edit, ttl_s: float | None = None
    ) -> EditResult:
        session = await self.store.get(tenant, sid)
        if session is None:
            return EditResult(edit, "rejected", "unknown_session")
        blocks = await self.retention.blocks.blocks_of(SessionKey(tenant, sid), session)
        if edit.block_end is not None and edit.block_end > len(blocks):
            return EditResult(
                edit, "rejected", "range_out_of_bounds", {"session_blocks": len(blocks)}
            )
        es = self.retention.engine_for(session)
        handler = {"evict": self._evict, "offload": self._offload, "prefetch": self._prefetch}
        if edit.type in handler:
            return await handler[edit.type](es, session, edit)
        return await self._pin(es, session, edit, ttl_s or self.max_ttl_s)

    # --- helpers ----------------------------------------------------------------------------
    async def _tokens(self, es: EngineState, session: Session, edit: Edit) -> list[int] | None:
        """The token ids of the session's prefix up to the edit's block_end (None: no context)."""
        blob = await self.store.get_context(session.tenant, session.session_id)
        if blob is None:
            return None
        ctx = decode_context(blob)
        tokens = await es.adapter.tokenize(ctx.route, ctx.body)
        if edit.block_end is not None:
            tokens = tokens[: edit.block_end * es.signals.block_size]
        return tokens

    async def _shared_blocks(self, session: Session) -> int:
        """Leading blocks shared with a live parent, sibling or child, or with any other session
        retention has learned (an agent's system prompt many users' sessions start with): kept
        on evict."""
        relatives: list[str] = list(session.children)
        if session.parent:
            relatives.append(session.parent)
            parent = await self.store.get(session.tenant, session.parent)
            if parent is not None:
                relatives.extend(c for c in parent.children if c != session.session_id)
        mine = await self.retention.blocks.blocks_of(
            SessionKey(session.tenant, session.session_id), session
        )
        shared = self.retention.blocks.shared_prefix(
            SessionKey(session.tenant, session.session_id), mine
        )
        for other in await self.store.get_many(session.tenant, relatives):
            if other is None or other.state not in ("active", "protected"):
                continue
            theirs = await self.retention.blocks.blocks_of(
                SessionKey(other.tenant, other.session_id), other
            )
            shared = max(shared, common_prefix(mine, theirs))
        return shared

    # --- the operations -----------------------------------------------------------------------
    async def _evict(self, es: EngineState, session: Session, edit: Edit) -> EditResult:
        tenant, sid = session.tenant, session.session_id
        start = edit.block_start or 0
        if start == 0:
            await self.store.protect(tenant, sid, time.time(), 0, state="idle", forget_engine=True)
        detail: dict[str, Any] = {
            "protection": "released" if start == 0 else "kept_below_block_start"
        }
        if start == 0 and self.longterm is not None and await self.longterm.release(tenant, sid):
            detail["long_retention"] = "released"
        if es.tier is not None:
            tokens = await self._tokens(es, session, edit)
            if tokens:
                keep = max(await self._shared_blocks(session), start) * es.signals.block_size
                if keep == 0:
                    res = await es.tier.delete_prefix(tokens)
                    detail["tier_chunks_deleted"] = res.chunks
                else:  # the shared prefix stays for the live relatives; so do our later chunks
                    detail["tier_chunks_deleted"] = 0
                    detail["shared_tokens_kept"] = keep
        if start > 0 and es.tier is None:
            return EditResult(edit, "unsupported", "partial_gpu_evict_needs_offload_tier")
        self.metrics.evictions.inc()
        return EditResult(edit, "applied", None, detail)

    async def _offload(self, es: EngineState, session: Session, edit: Edit) -> EditResult:
        if es.tier is None:
            return EditResult(edit, "unsupported", "no_offload_tier")
        tokens = await self._tokens(es, session, edit)
        if not tokens:
            return EditResult(edit, "rejected", "no_recorded_context")
        chunk = await es.tier.chunk_tokens()
        want = len(tokens) // chunk * chunk
        stored = await es.tier.lookup(tokens)
        touched = False
        if stored < want:  # not (fully) in the tier yet: one touch stores it through the connector
            # what the engine no longer holds is re-prefilled just to be stored: retention's
            # cost, within its credit like a warm-up's
            missing = await self._lost_blocks(es, session, edit)
            paid = await self._paid_replay(es, session, edit, missing * es.signals.block_size + 1)
            if isinstance(paid, EditResult):
                return paid
            touched = True
            stored = await es.tier.lookup(tokens)
        if stored < want:
            return EditResult(
                edit,
                "failed",
                "not_stored_in_tier",
                {"stored_tokens": stored, "wanted_tokens": want},
            )
        pinned = await es.tier.pin(tokens[:stored])
        await self.store.protect(
            session.tenant, session.session_id, time.time(), 0, state="offloaded"
        )
        self.metrics.offloads.inc()
        return EditResult(
            edit,
            "applied",
            None,
            {"stored_tokens": stored, "pinned_chunks": pinned, "touched": touched},
        )

    async def _prefix_blocks(self, session: Session, edit: Edit) -> tuple[int, ...]:
        """The block ids of the session's prefix the edit covers (up to ``edit.block_end``)."""
        blocks = await self.retention.blocks.blocks_of(
            SessionKey(session.tenant, session.session_id), session
        )
        return blocks[: edit.block_end] if edit.block_end is not None else blocks

    async def _lost_blocks(self, es: EngineState, session: Session, edit: Edit) -> int:
        """Blocks of the session's prefix (up to ``edit.block_end``) the engine no longer holds
        (0 without KV events: unknown)."""
        if not es.signals.has_events:
            return 0
        blocks = await self._prefix_blocks(session, edit)
        return len(blocks) - es.signals.resident_prefix(blocks) if blocks else 0

    async def _prefetch(self, es: EngineState, session: Session, edit: Edit) -> EditResult:
        detail: dict[str, Any] = {}
        tier_tokens: int | None = None
        if es.tier is not None:
            tokens = await self._tokens(es, session, edit)
            if tokens:
                tier_tokens = detail["tier_tokens"] = await es.tier.lookup(tokens)
            if tokens and tier_tokens:
                # stage what the tier holds into its memory level first (LMCache MP: L2 -> L1):
                # the warm-up then loads it instead of recomputing what sits only on disk
                try:
                    detail["staged_chunks"] = await es.tier.prefetch_to_l1(
                        tokens[:tier_tokens], timeout_s=10.0
                    )
                except (AdapterError, aiohttp.ClientError, TimeoutError) as exc:
                    detail["staged_chunks"] = 0
                    detail["staging_error"] = str(exc)[:200]
        cost = await self._warmup_cost(es, session, edit, tier_tokens)
        if isinstance(cost, EditResult):
            return cost
        result = await self._paid_replay(es, session, edit, cost)
        if isinstance(result, EditResult):
            return result
        if result is None:
            return EditResult(edit, "rejected", "no_recorded_context")
        self.metrics.prefetches.inc()
        detail.update(
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            seconds=round(result.seconds, 4),
        )
        if session.state == "offloaded":
            await self.store.protect(
                session.tenant, session.session_id, time.time(), 0, state="idle"
            )
        return EditResult(edit, "applied", None, detail)

    async def _paid_replay(
        self, es: EngineState, session: Session, edit: Edit, recompute_tokens: int
    ) -> EditResult | TouchResult | None:
        """Re-send the session's prefix (a warm-up) when the engine's retention credit covers
        the ``recompute_tokens`` it is expected to cost, settled afterwards with what it did
        recompute; else why not (the guard holding retention back on the engine included).
        None: no recorded context."""
        guards = self.retention.guards
        if guards is not None and not guards.allows(es.name, time.time()):
            return EditResult(
                edit, "rejected", "retention_backed_off", guards.view(es.name, time.time())
            )
        if not es.signals.overhead.admit(recompute_tokens):
            return EditResult(
                edit,
                "rejected",
                "exceeds_overhead_budget",
                {
                    "recompute_tokens": recompute_tokens,
                    "credit_tokens": int(es.signals.overhead.credit),
                },
            )
        result = None
        load = es.signals.load
        waiting = float(load.waiting or 0) if load is not None else 0.0
        try:
            result = await self.retention.touches.replay(
                es,
                SessionKey(session.tenant, session.session_id),
                warmup=True,
                limit_blocks=edit.block_end,
            )
        finally:
            recomputed = result.recomputed_tokens if result else 0
            es.signals.overhead.settle(recompute_tokens, recomputed)
            if guards is not None:
                guards.spent(es.name, recomputed, waiting, time.time())
        return result

    async def _warmup_cost(
        self, es: EngineState, session: Session, edit: Edit, tier_tokens: int | None = None
    ) -> EditResult | int:
        """The tokens a warm-up is expected to recompute, or why it is declined.

        A warm-up loads what the offload tier holds (``tier_tokens`` of the prefix) and
        re-prefills what neither the engine nor the tier kept. Decline it when that lost part
        is more than ``PREFETCH_MAX_POOL_SHARE`` of the pool: LRU would evict it (and others'
        prefixes) again before the resume, which pays for it anyway if it comes. Decline it
        too while requests wait at the engine (its pool or its token budget is full): the
        re-prefill would only move the resume's compute ahead of theirs, and evict what they
        are about to use; and (:meth:`_paid_replay`) when the engine's retention credit
        (``max_overhead_share``) does not cover the re-prefill. (A resident prefix is still
        warmed: that costs one token and moves it to LRU's safe end.) Without KV events the
        lost part is unknown: the warm-up runs while the credit is not overdrawn, and pays what
        it recomputed afterwards."""
        declined = await self._decline_warmup(es, session, edit, tier_tokens)
        if isinstance(declined, EditResult):
            return declined
        return declined * es.signals.block_size + 1 if declined else 1

    async def _decline_warmup(
        self, es: EngineState, session: Session, edit: Edit, tier_tokens: int | None
    ) -> EditResult | int | None:
        """The prefix blocks a warm-up would re-prefill (None: unknown), or why it is declined
        (see :meth:`_warmup_cost`)."""
        if not es.signals.has_events or es.signals.load is None:
            return None
        blocks = await self._prefix_blocks(session, edit)
        if not blocks:
            return None
        in_tier = (tier_tokens or 0) // es.signals.block_size
        kept = max(es.signals.resident_prefix(blocks), in_tier)
        missing = len(blocks) - min(kept, len(blocks))
        detail = {"blocks": len(blocks), "missing_blocks": missing}
        if tier_tokens is not None:
            detail["tier_tokens"] = tier_tokens
        limit = PREFETCH_MAX_POOL_SHARE * es.signals.load.pool_blocks
        if missing > limit:
            detail["limit_blocks"] = int(limit)
            return EditResult(edit, "rejected", "exceeds_prefetch_budget", detail)
        if missing:
            load = await es.signals.fresh_load()
            waiting = (load.waiting or 0) if load is not None else 0
            if waiting > 0:
                detail["waiting"] = int(waiting)
                return EditResult(edit, "rejected", "engine_busy", detail)
        return missing

    async def _pin(self, es: EngineState, session: Session, edit: Edit, ttl_s: float) -> EditResult:
        await self.store.protect(
            session.tenant, session.session_id, time.time(), ttl_s, state="protected"
        )
        detail: dict[str, Any] = {"ttl_s": ttl_s}
        if es.tier is not None:
            tokens = await self._tokens(es, session, edit)
            if tokens:
                detail["tier_pinned_chunks"] = await es.tier.pin(tokens)
        return EditResult(edit, "applied", None, detail)
