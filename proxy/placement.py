"""Placement: which engine a request goes to, best first, from the engines' signals.

With several engines, a request with a prompt-chunk ``chain`` is placed by its own prompt
(``policy.routing.place_by_prefix``): the replica where its prefill would finish first,
counting the prefill already queued there and the part of this prompt that replica was never
sent. The prompt is the evidence, not the session: an agent session calling sub-agents with
other system prompts has different prefixes on different replicas. Without a chain (a prompt
under one chunk): the session's affinity, its parent's engine and its resident blocks
(``policy.routing.route``), else the least loaded engine, round robin on ties.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
from policy.smoothing import Ewma
from proxy.keys import SessionKey
from proxy.metrics import Metrics
from proxy.prefix_share import PrefixShare
from proxy.settings import PlacementSettings
from proxy.upstream import Engine, EnginePool

PREFIX_CHUNK_BYTES = 1024  # prompt chunk of the prefix index (about 170-250 tokens)
PREFIX_MAX_CHUNKS = 1024
# a prompt token to compute costs this many queued ones: higher keeps prefixes where they are
MISS_WEIGHT = 3.0
# KV caches' worth of prompt chunks the prefix index remembers per engine
INDEX_POOL_FACTOR = 1.0

KnownBlocks = Callable[[SessionKey], tuple[int, ...]]  # a session's learned block ids, no I/O


@dataclass(frozen=True, slots=True)
class Affinity:
    """What ties a session's request to engines: its own and its parent's last engine."""

    engine: str | None
    parent_engine: str | None


class Placer:
    """Orders the engines for each request and tracks what placement weighs."""

    def __init__(
        self,
        pool: EnginePool,
        settings: PlacementSettings,
        metrics: Metrics,
        known_blocks: KnownBlocks | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.known_blocks = known_blocks  # None: no retention layer learns block ids
        self.share: PrefixShare | None = None  # tells the other replicas what was placed
        self.prefixes = PrefixIndex()  # prompt chunks sent per engine
        self.bytes_per_token = Ewma(0.05, 4.0)  # request body bytes per prompt token
        # per engine: uncached prompt tokens sent whose first byte has not come back
        self.prefill_pending: dict[str, float] = {}
        self._rr = itertools.count()
        self._config = PrefixPlacementConfig(miss_weight=MISS_WEIGHT)

    def learn_size(self, body_bytes: int, prompt_tokens: int) -> None:
        """Calibrate the body-size estimate of a prompt's tokens from the engine's usage."""
        if prompt_tokens > 0 and body_bytes > 0:
            self.bytes_per_token.add(body_bytes / prompt_tokens)

    def tokens_in(self, body_bytes: int) -> float:
        return body_bytes / max(self.bytes_per_token.get(), 0.5)

    @property
    def chunk_tokens(self) -> float:
        """Prompt tokens in one prefix-index chunk (learned bytes per token)."""
        return self.tokens_in(PREFIX_CHUNK_BYTES)

    def uncached_estimate(self, engine: Engine, body_bytes: int, key: SessionKey | None) -> float:
        """Tokens ``engine`` would compute for this request: its size minus the session's
        resident prefix (admission order; an estimate, never used for accounting)."""
        total = self.tokens_in(body_bytes)
        blocks = self.known_blocks(key) if key is not None and self.known_blocks else ()
        if not blocks:
            return total
        signals = engine.signals
        return total - min(total, signals.resident_prefix(blocks) * signals.block_size)

    def order(
        self, affinity: Affinity | None, key: SessionKey | None, chain: Sequence[bytes] = ()
    ) -> list[Engine]:
        """The engines to try, best first (module docstring)."""
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
            # full ties go the same way in every replica and worker: the engines in an order
            # from the prompt's first chunk, not this process's rotation or requests in flight
            start = int.from_bytes(chain[0][:4], "big") % len(engines)
            by_prompt = engines[start:] + engines[:start]
            return self._by_prompt(sorted(by_prompt, key=lambda e: not e.healthy), chain)
        if affinity is None:
            return ranked
        if self.known_blocks is not None:
            return self._by_session(affinity, key, ranked)
        preferred: list[Engine] = []
        for name in (affinity.engine, affinity.parent_engine):
            eng = self.pool.get(name)
            if eng is not None and eng.healthy and eng not in preferred:
                preferred.append(eng)
        return preferred + [e for e in ranked if e not in preferred]

    def _by_prompt(self, ranked: list[Engine], chain: Sequence[bytes]) -> list[Engine]:
        for e in ranked:  # the index remembers about what each engine's cache holds
            pool = e.signals.pool_tokens()
            limit = int(INDEX_POOL_FACTOR * pool / self.chunk_tokens) if pool is not None else None
            if limit is not None and limit != self.prefixes.limit(e.name):
                self.prefixes.set_limit(e.name, limit)
        decision = place_by_prefix(
            [
                PrefixCandidate(
                    name=e.name,
                    healthy=e.healthy,
                    matched=self.prefixes.match(e.name, chain),
                    cached=self.prefixes.size(e.name),
                    pending=self.prefill_pending.get(e.name, 0.0)
                    + (self.share.others_queued(e.name) if self.share is not None else 0.0),
                )
                for e in ranked
            ],
            len(chain),
            self.chunk_tokens,
            self._config,
        )
        if decision.engine is not None:
            self.metrics.child(self.metrics.placements, decision.engine, decision.reason).inc()
        return self._ordered(decision, ranked)

    def _by_session(
        self, affinity: Affinity, key: SessionKey | None, ranked: list[Engine]
    ) -> list[Engine]:
        """A session's request without a prompt chain: its affinity, its parent's engine and
        where its learned blocks are resident, weighed against load."""
        assert self.known_blocks is not None
        blocks = self.known_blocks(key) if key is not None else ()
        candidates = []
        for engine in ranked:
            load = engine.signals.load
            candidates.append(
                EngineCandidate(
                    name=engine.name,
                    healthy=engine.healthy,
                    kv_cache_usage=(load.kv_cache_usage or 0.0) if load else 0.0,
                    waiting=(load.waiting or 0.0) if load else 0.0,
                    running=max(float(engine.inflight), (load.running or 0.0) if load else 0.0),
                    resident_prefix_blocks=engine.signals.resident_prefix(blocks),
                )
            )
        if not (affinity.engine or affinity.parent_engine) and not any(
            c.resident_prefix_blocks for c in candidates
        ):
            return ranked  # nothing ties it to a replica: least loaded, round robin on ties
        decision = route(
            candidates,
            RouteRequest(
                prompt_blocks=len(blocks),
                affinity=affinity.engine,
                parent_engine=affinity.parent_engine,
            ),
        )
        return self._ordered(decision, ranked)

    def _ordered(self, decision: RouteDecision, ranked: list[Engine]) -> list[Engine]:
        order = [self.pool.by_name[n] for n in (decision.engine, *decision.failover) if n]
        return order + [e for e in ranked if e not in order]  # unhealthy ones last

    # --- prefill queued per engine -------------------------------------------------------------
    def prefill_started(self, engine: str, body_bytes: int, chain: Sequence[bytes]) -> float:
        """Count a request's uncached prompt tokens as prefill queued at ``engine`` and record
        its chain there (requests placed while it waits must see it); the amount counted."""
        tokens = max(
            0.0, self.tokens_in(body_bytes) - self.prefixes.match(engine, chain) * self.chunk_tokens
        )
        self.placed(engine, chain)
        self.prefill_pending[engine] = self.prefill_pending.get(engine, 0.0) + tokens
        if self.share is not None and tokens:
            self.share.queued(engine, tokens)
        return tokens

    def placed(self, engine: str, chain: Sequence[bytes]) -> None:
        """``chain`` is sent to ``engine``: remembered here and by every other replica."""
        self.prefixes.insert(engine, chain)
        if self.share is not None:
            self.share.placed(engine, chain)

    def prefill_done(self, engine: str, tokens: float) -> None:
        """The request's first byte came back (its prefill ran), or it ended without one."""
        self.prefill_pending[engine] = max(0.0, self.prefill_pending.get(engine, 0.0) - tokens)
        if self.share is not None and tokens:
            self.share.queued(engine, -tokens)


class Prefill:
    """A request's uncached prompt tokens counted as prefill queued at its engine, released
    once: at the first byte back, or when the request ends without."""

    __slots__ = ("body_bytes", "chain", "engine", "placer", "tokens")

    def __init__(self, placer: Placer, engine: str, body_bytes: int, chain: list[bytes]) -> None:
        self.placer, self.engine, self.body_bytes, self.chain = placer, engine, body_bytes, chain
        self.tokens = placer.prefill_started(engine, body_bytes, chain)

    def move(self, engine: str) -> None:
        """The request failed over: its prefill is queued at ``engine`` now."""
        self.release()
        self.engine = engine
        self.tokens = self.placer.prefill_started(engine, self.body_bytes, self.chain)

    def release(self) -> None:
        if self.tokens:
            self.placer.prefill_done(self.engine, self.tokens)
            self.tokens = 0.0
