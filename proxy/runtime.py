"""The live state of one kvkeeper process, shared by handlers and workers through one AppKey."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from policy.prefix_index import PrefixIndex
from policy.routing import (
    EngineCandidate,
    PrefixCandidate,
    PrefixPlacementConfig,
    RouteDecision,
    RouteRequest,
    place_by_prefix,
    route,
)
from proxy.auth import TenantMap
from proxy.dispatch import DispatchGate
from proxy.edits import EditExecutor, UnsupportedEdits
from proxy.hints import Hint
from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.store import SessionStore, StoreDown, StoreRejected, Upserted
from proxy.upstream import Engine, EnginePool

if TYPE_CHECKING:
    from proxy.completions import CompletionWriter
    from proxy.longterm import LongRetention
    from proxy.prefix_share import PrefixShare
    from proxy.retention import Retention

log = logging.getLogger("kvkeeper.runtime")

PREFIX_CHUNK_BYTES = 1024  # prompt chunk of the prefix index (about 170-250 tokens)
PREFIX_MAX_CHUNKS = 1024


@dataclass(frozen=True, slots=True)
class Registration:
    """What the session plane said about a hinted request."""

    outcome: str  # the X-KVKeeper-Hint header value
    upserted: Upserted | None  # None when the hint could not be recorded


@dataclass
class Runtime:
    settings: Settings
    metrics: Metrics
    tenants: TenantMap
    pool: EnginePool
    store: SessionStore | None
    edits: EditExecutor = field(default_factory=UnsupportedEdits)
    retention: Retention | None = None
    longterm: LongRetention | None = None  # retention beyond the GPU cap (proxy/longterm.py)
    completions: CompletionWriter | None = None
    dispatch: DispatchGate | None = None
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # prompt chunks sent per engine
    prefix_share: PrefixShare | None = None  # ``prefixes`` shared with the other replicas
    bytes_per_token: float = 4.0  # request body bytes per prompt token, learned from usage
    # per engine: uncached prompt tokens sent whose first byte has not come back (placement)
    prefill_pending: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _rr: itertools.count[int] = field(default_factory=itertools.count)
    _placement: PrefixPlacementConfig = field(init=False)

    def __post_init__(self) -> None:
        self._placement = PrefixPlacementConfig(miss_weight=self.settings.placement.miss_weight)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run work off the hot path; keep a reference so it is not collected mid-flight."""
        self.keep(asyncio.create_task(coro))

    def keep(self, task: asyncio.Task[Any]) -> None:
        """Hold a started task until it ends (drained at shutdown, failures logged)."""
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task failed: %r", exc)

    async def drain(self, grace_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)

    def learn_size(self, body_bytes: int, prompt_tokens: int) -> None:
        """Calibrate the body-size estimate of a prompt's tokens from the engine's usage."""
        if prompt_tokens > 0 and body_bytes > 0:
            self.bytes_per_token += 0.05 * (body_bytes / prompt_tokens - self.bytes_per_token)

    def uncached_estimate(
        self, engine: str, body_bytes: int, session: tuple[str, str] | None
    ) -> tuple[float, float]:
        """(tokens ``engine`` would compute for this request, tokens of it resident there): its
        size minus the session's resident prefix (dispatch and admission order; an estimate,
        never used for accounting)."""
        total = body_bytes / max(self.bytes_per_token, 0.5)
        if session is None or self.retention is None:
            return total, 0.0
        es = self.retention.engines.get(engine)
        blocks = self.retention.known_blocks(*session)
        if es is None or not blocks:
            return total, 0.0
        resident = min(total, es.index.resident_prefix(blocks) * es.adapter.cache.block_size)
        return total - resident, resident

    async def settle(self) -> None:
        """Write finished requests still buffered, so the next read sees them."""
        if self.completions is not None:
            with contextlib.suppress(StoreDown):
                await self.completions.flush()

    async def register(self, tenant: str, hint: Hint) -> Registration:
        """Upsert the hint's session; never raises: Redis trouble fails open."""
        notes = "".join(f"; note={n}" for n in hint.notes)
        if self.store is None:
            return Registration("rejected; reason=store_unavailable", None)
        try:
            up = await self.store.upsert(tenant, hint, time.time())
        except StoreRejected as exc:
            self.metrics.child(self.metrics.hint_outcomes, "rejected", exc.reason).inc()
            return Registration(f"rejected; reason={exc.reason}", None)
        except StoreDown:
            self.metrics.fail_open.inc()
            self.metrics.child(self.metrics.hint_outcomes, "rejected", "store_unavailable").inc()
            return Registration("rejected; reason=store_unavailable", None)
        if up.created:
            self.metrics.sessions_created.inc()
        self.metrics.child(self.metrics.hint_outcomes, "accepted", "").inc()
        return Registration("accepted" + notes, self._with_buffered(tenant, hint, up))

    async def unregister_failed(
        self, tenant: str, hint: Hint, registering: asyncio.Task[Registration]
    ) -> None:
        """The request failed upstream: a session its registration created is removed again
        (kept if another request has used it meanwhile); a kept one is not left ``active``."""
        reg = await registering
        if reg.upserted is None or self.store is None:
            return
        with contextlib.suppress(StoreDown):
            if await self.store.unregister(tenant, hint, time.time()):
                self.metrics.child(self.metrics.hint_outcomes, "unregistered", "").inc()

    def _with_buffered(self, tenant: str, hint: Hint, up: Upserted) -> Upserted:
        """Newer facts of this process's still-buffered completions override Redis's."""
        if self.completions is None:
            return up
        own = self.completions.latest(tenant, hint.session_id)
        parent = (
            self.completions.latest(tenant, hint.parent_session_id)
            if hint.parent_session_id
            else None
        )
        if own is None and parent is None:
            return up
        engine, last_active, last_prompt = up.engine, up.last_active, up.last_prompt_tokens
        if own is not None and own[1] >= up.last_active:
            engine, last_active, last_prompt = own
        return dataclasses.replace(
            up,
            engine=engine,
            parent_engine=parent[0] if parent is not None else up.parent_engine,
            last_active=last_active,
            last_prompt_tokens=last_prompt,
        )

    def engine_order(
        self,
        upserted: Upserted | None,
        session: tuple[str, str] | None = None,
        chain: Sequence[bytes] = (),
    ) -> list[Engine]:
        """The engines to try, best first.

        With several engines, a request is placed by its own prompt when it has a ``chain`` of
        prompt-chunk hashes (``policy.routing.place_by_prefix``): the replica where its prefill
        would finish first, counting the prefill already queued there and the part of this
        prompt that replica was never sent. The prompt is the evidence, not the session: an
        agent session calling sub-agents with other system prompts has different prefixes on
        different replicas, and following the session piled every shared prompt, then all
        traffic, onto one replica.
        Without a chain (a prompt under one chunk): the session's affinity, its parent's engine
        and its resident blocks (``policy.routing.route``, with the retention layer), else the
        least loaded engine, round robin on ties.
        """
        # an engine its health check found not ready gets no new requests until a check finds
        # it back (a hung engine would hold them until the read timeout); one that only failed
        # a connection stays a last resort
        engines = [e for e in self.pool.engines if e.ready]
        if not engines:
            return []
        start = next(self._rr) % len(engines)
        rotated = engines[start:] + engines[:start]
        ranked = sorted(rotated, key=lambda e: (not e.healthy, e.inflight))
        if len(engines) == 1:
            return ranked
        if chain:
            return self._by_prompt(ranked, chain)
        if self.retention is not None and upserted is not None:
            return self._placed(upserted, session, ranked)
        if upserted is None:
            return ranked
        preferred: list[Engine] = []
        for name in (upserted.engine, upserted.parent_engine):
            eng = self.pool.get(name)
            if eng is not None and eng.healthy and eng not in preferred:
                preferred.append(eng)
        return preferred + [e for e in ranked if e not in preferred]

    def _by_prompt(self, ranked: list[Engine], chain: Sequence[bytes]) -> list[Engine]:
        if self.retention is not None:  # the index remembers what each engine's cache holds
            for e in ranked:
                pool = self.retention.pool_tokens(e.name)
                factor = self.settings.placement.index_pool_factor
                limit = int(factor * pool / self.chunk_tokens) if pool is not None else None
                if limit is not None and limit != self.prefixes.limit(e.name):
                    self.prefixes.set_limit(e.name, limit)
        decision = place_by_prefix(
            [
                PrefixCandidate(
                    name=e.name,
                    healthy=e.healthy,
                    matched=self.prefixes.match(e.name, chain),
                    cached=self.prefixes.size(e.name),
                    pending=self.prefill_pending.get(e.name, 0.0),
                )
                for e in ranked
            ],
            len(chain),
            self.chunk_tokens,
            self._placement,
        )
        if decision.engine is not None:
            self.metrics.child(self.metrics.placements, decision.engine, decision.reason).inc()
        return self._ordered(decision, ranked)

    def placed(self, engine: str, chain: Sequence[bytes]) -> None:
        """``chain`` is sent to ``engine``: remembered here and by every other replica."""
        self.prefixes.insert(engine, chain)
        if self.prefix_share is not None:
            self.prefix_share.placed(engine, chain)

    @property
    def chunk_tokens(self) -> float:
        """Prompt tokens in one prefix-index chunk (learned bytes per token)."""
        return PREFIX_CHUNK_BYTES / max(self.bytes_per_token, 0.5)

    def prefill_started(self, engine: str, body_bytes: int, chain: Sequence[bytes]) -> float:
        """Count a request's uncached prompt tokens as prefill queued at ``engine`` (an
        estimate from its size and its matched prefix); returns the amount, for
        ``prefill_done``."""
        total = body_bytes / max(self.bytes_per_token, 0.5)
        tokens = max(0.0, total - self.prefixes.match(engine, chain) * self.chunk_tokens)
        self.prefill_pending[engine] = self.prefill_pending.get(engine, 0.0) + tokens
        return tokens

    def prefill_done(self, engine: str, tokens: float) -> None:
        """The request's first byte came back (its prefill ran), or it ended without one."""
        self.prefill_pending[engine] = max(0.0, self.prefill_pending.get(engine, 0.0) - tokens)

    def _ordered(self, decision: RouteDecision, ranked: list[Engine]) -> list[Engine]:
        order = [self.pool.by_name[n] for n in (decision.engine, *decision.failover) if n]
        return order + [e for e in ranked if e not in order]  # unhealthy ones last

    def _placed(
        self, upserted: Upserted, session: tuple[str, str] | None, ranked: list[Engine]
    ) -> list[Engine]:
        """A session's request without a prompt chain: its affinity, its parent's engine and
        where its learned blocks are resident, weighed against load."""
        assert self.retention is not None
        blocks = self.retention.known_blocks(*session) if session is not None else ()
        candidates = []
        for engine in ranked:
            es = self.retention.engines[engine.name]
            load = es.load
            candidates.append(
                EngineCandidate(
                    name=engine.name,
                    healthy=engine.healthy,
                    kv_cache_usage=(load.kv_cache_usage or 0.0) if load else 0.0,
                    waiting=(load.waiting or 0.0) if load else 0.0,
                    running=max(float(engine.inflight), (load.running or 0.0) if load else 0.0),
                    resident_prefix_blocks=es.index.resident_prefix(blocks) if blocks else 0,
                )
            )
        if not (upserted.engine or upserted.parent_engine) and not any(
            c.resident_prefix_blocks for c in candidates
        ):
            return ranked  # nothing ties it to a replica: least loaded, round robin on ties
        decision = route(
            candidates,
            RouteRequest(
                prompt_blocks=len(blocks),
                affinity=upserted.engine,
                parent_engine=upserted.parent_engine,
            ),
        )
        return self._ordered(decision, ranked)


RUNTIME = web.AppKey("runtime", Runtime)
