"""Agent anchors kept warm on each engine for the agents predicted to run next (CacheScout);
off by default (``anchors.enabled``).

Fed from the request path (:meth:`AnchorKeeper.observe`, no I/O): every hinted request that
names its agent (``X-Agent-Name``) teaches the next-agent model (:mod:`policy.predictor`) one
transition of its session and stamps the agent's anchor on that engine as used. An anchor is
learned from two calls of one agent by different sessions of one tenant: both are tokenized
and their common leading whole blocks are the anchor (tenants never share anchors: one
tenant's prompt is never replayed for another). Each retention tick then touches the anchors
:func:`policy.anchors.plan_anchor_touches` picks: a one-token request over the anchor's tokens
that refreshes its blocks before LRU reaches them. A touch counts like a session's keep-alive
touch in the retention overhead (``kvkeeper_touch_prompt_tokens_total`` and
``kvkeeper_touch_recomputed_tokens_total``) and by itself in
``kvkeeper_anchor_touches_total{engine,outcome}``.

"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from adapters.base import AdapterError
from policy.anchors import (
    AnchorConfig,
    AnchorView,
    anchor_demand,
    common_prefix,
    plan_anchor_touches,
)
from policy.budget import BudgetConfig, effective_budget
from policy.overhead import ANCHOR_TOUCH
from policy.predictor import TransitionModel
from proxy.engine_state import EngineState
from proxy.metrics import Metrics
from proxy.touches import TouchLate, TouchRunner

log = logging.getLogger("kvkeeper.anchors")

_MAX_SESSIONS = 100_000  # sessions whose last agent is remembered (least recent dropped)
_MAX_ANCHORS = 1024  # anchors per engine (the least recently used dropped)
MIN_DEMAND = 0.5  # expected next calls of an agent to keep its anchor
POOL_SHARE = 0.25  # anchor blocks at most this share of the pool ...
MIN_FACTOR = 0.1  # ... of which this share is kept at full pressure (the budget's rule)
WINDOW_S = 30.0  # a session idle longer stops counting in its next agent's demand
MIN_BLOCKS = 4  # a shorter common prefix is no anchor
RELEARN_CALLS = 200  # learn an anchor again after this many calls of its agent


class AnchorId(NamedTuple):
    """An anchor's key: the tenant and the agent (tenants never share anchors)."""

    tenant: str
    agent: str


@dataclass(slots=True)
class Sample:
    """One call of the agent: the body it was sent with (JSON, hints stripped)."""

    session_id: str
    route: str
    body: bytes


@dataclass(slots=True)
class Anchor:
    """One agent's anchor on one engine, for one tenant."""

    agent: str
    first: Sample | None = None
    second: Sample | None = None
    tokens: list[int] = field(default_factory=list)  # the anchor, plus one token past it
    blocks: tuple[int, ...] = ()
    cache_salt: str | None = None
    last_used: float = 0.0
    held: bool = False  # last used by a touch, not by a call of its agent
    calls_since_learned: int = 0
    learn_after: int = 0  # calls to let pass before sampling again (relearn, or back off)
    failures: int = 0  # learning attempts in a row that found no common prefix
    in_flight: bool = False

    def touch_done(self) -> None:
        self.in_flight = False

    @property
    def learnable(self) -> bool:
        return self.first is not None and self.second is not None


class AnchorKeeper:
    """What the retention layer knows about agents: their anchors and who runs next."""

    def __init__(
        self,
        metrics: Metrics,
        touches: TouchRunner,
        *,
        safety_fraction: float,
        max_touches: int,
        window_s: float = WINDOW_S,
        relearn_calls: int = RELEARN_CALLS,
    ) -> None:
        self.metrics = metrics
        self.touches = touches
        self.max_touches = max_touches
        self.window_s = window_s
        self.relearn_calls = relearn_calls
        self.models: dict[str, TransitionModel] = {}  # per tenant: tenants never mix
        self.config = AnchorConfig(min_demand=MIN_DEMAND, safety_fraction=safety_fraction)
        # (tenant, session) -> (its last agent, when): the sessions whose next call is predicted,
        # least recently active first
        self._last: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        # engine -> (tenant, agent) -> anchor
        self.anchors: dict[str, dict[tuple[str, str], Anchor]] = {}

    # --- the request path (no I/O) ----------------------------------------------------------
    def observe(
        self,
        engine: str,
        tenant: str,
        sid: str,
        agent: str,
        route: str,
        body: bytes,
        now: float,
        *,
        tokenizable: bool = True,
    ) -> None:
        """A request of ``sid`` by ``agent`` was served by ``engine`` (``tokenizable``: the
        engine can tokenize ``route``, so its anchor can be learned)."""
        key = (tenant, sid)
        prev = self._last.pop(key, None)
        model = self.models.get(tenant)
        if model is None:
            model = self.models[tenant] = TransitionModel()
        model.observe(prev[0] if prev is not None else None, agent)
        self._last[key] = (agent, now)
        while len(self._last) > _MAX_SESSIONS:
            self._last.popitem(last=False)
        if not tokenizable:
            return
        mine = self.anchors.setdefault(engine, {})
        anchor = mine.get((tenant, agent))
        if anchor is None:
            if len(mine) >= _MAX_ANCHORS:  # agent names come from clients: bounded
                del mine[min(mine, key=lambda k: mine[k].last_used)]
            anchor = mine[(tenant, agent)] = Anchor(agent)
        anchor.last_used, anchor.held = now, False
        anchor.calls_since_learned += 1
        if anchor.calls_since_learned < anchor.learn_after:
            return
        sample = Sample(sid, route, body)
        if anchor.first is None or anchor.first.session_id == sid:
            anchor.first = sample
        elif anchor.first.route == route:
            anchor.second = sample

    def forget(self, tenant: str, sid: str) -> None:
        """The session ended: it no longer counts in any agent's demand."""
        self._last.pop((tenant, sid), None)

    def demand(self, now: float) -> dict[AnchorId, float]:
        """Expected next calls per (tenant, agent) from the sessions active within
        ``window_s``."""
        since = now - self.window_s
        live: dict[str, dict[str, int]] = {}  # tenant -> last agent -> live sessions
        for (tenant, _), (agent, at) in reversed(self._last.items()):  # most recent first
            if at < since:
                break
            by_agent = live.setdefault(tenant, {})
            by_agent[agent] = by_agent.get(agent, 0) + 1
        return {
            AnchorId(tenant, agent): d
            for tenant, by_agent in live.items()
            for agent, d in anchor_demand(by_agent, self.models[tenant]).items()
        }

    # --- the retention tick -----------------------------------------------------------------
    async def tick(self, es: EngineState, now: float, horizon_s: float) -> None:
        """Learn the anchors that have two samples, then touch the ones the plan picks."""
        mine = self.anchors.get(es.name)
        if not mine:
            return
        for anchor in list(mine.values()):  # (requests may add anchors while this awaits)
            if anchor.learnable:
                await self._learn(es, anchor, now)
        signals = es.signals
        if not signals.has_events or signals.load is None:
            return  # without KV events nothing says which anchor blocks are still cached
        demand = self.demand(now)
        views: dict[tuple[str, str], tuple[Anchor, AnchorView[tuple[str, str]]]] = {}
        for (tenant, agent), anchor in mine.items():
            if anchor.blocks:
                anchor_id = AnchorId(tenant, agent)
                views[anchor_id] = (
                    anchor,
                    AnchorView(
                        anchor_id=anchor_id,
                        n_blocks=len(anchor.blocks),
                        resident_blocks=signals.resident_prefix(anchor.blocks),
                        last_used_at=anchor.last_used,
                        demand=demand.get(anchor_id, 0.0),
                        allocated_since=signals.tap.allocated_since(anchor.last_used),
                        touch_in_flight=anchor.in_flight,
                        held=anchor.held,
                    ),
                )
        if not views:
            return
        chosen = plan_anchor_touches(
            [v for _, v in views.values()],
            horizon_s,
            now,
            # the soft-TTL budget's rule: the share shrinks as traffic needs the space
            max_blocks=effective_budget(
                signals.load, BudgetConfig(share=POOL_SHARE, min_factor=MIN_FACTOR)
            )[0],
            urgent_blocks=self.config.safety_fraction * signals.load.free_blocks,
            slots=self.max_touches - sum(a.in_flight for a, _ in views.values()),
            config=self.config,
        )
        for chosen_id in chosen:
            anchor, view = views[chosen_id]
            reserved = signals.overhead.admit_touch(ANCHOR_TOUCH)
            if reserved is None:
                self.metrics.anchor_touches.labels(es.name, "over_budget").inc()
                continue
            anchor.in_flight = True
            self.touches.track(
                es,
                self._touch(es, anchor, view.resident_blocks),
                reserved,
                anchor.touch_done,
                ANCHOR_TOUCH,
            )

    async def _learn(self, es: EngineState, anchor: Anchor, now: float) -> None:
        """The common leading whole blocks of the two samples' token ids."""
        first, second = anchor.first, anchor.second
        assert first is not None and second is not None
        anchor.first, anchor.second = second, None  # the newer sample pairs with the next one
        try:
            a_body, b_body = json.loads(first.body), json.loads(second.body)
            a = await es.adapter.tokenize(first.route, a_body)
            b = await es.adapter.tokenize(second.route, b_body)
        except (AdapterError, ValueError, TypeError, KeyError) as exc:
            log.debug("anchor of %s not learned: %s", anchor.agent, exc)
            return
        bs = es.signals.block_size
        n_blocks = common_prefix(a, b) // bs
        anchor.calls_since_learned = 0
        if n_blocks < MIN_BLOCKS:
            # calls of this agent share no anchor (yet): ask again after 1, 2, 4... calls
            anchor.failures += 1
            anchor.learn_after = min(self.relearn_calls, 2**anchor.failures)
            return
        salt = a_body.get("cache_salt") if isinstance(a_body, dict) else None
        anchor.cache_salt = salt if isinstance(salt, str) else None
        # one token past the last whole block: vLLM looks up at most prompt - 1 tokens
        anchor.tokens = a[: n_blocks * bs + 1]
        anchor.blocks = tuple(es.adapter.hash_blocks(a[: n_blocks * bs], cache_salt=salt))
        anchor.failures, anchor.learn_after = 0, self.relearn_calls
        anchor.first = anchor.second = None

    async def _touch(self, es: EngineState, anchor: Anchor, resident: int) -> int:
        """Re-send the anchor's still-resident blocks (plus one token), like a session touch;
        the prompt tokens it recomputed."""
        tokens = anchor.tokens[: resident * es.signals.block_size + 1]
        es.signals.sent(len(tokens))
        try:
            result = await self.touches.in_time(
                es.adapter.touch_tokens(tokens, cache_salt=anchor.cache_salt)
            )
        except TouchLate:  # not served within the touch deadline: abandoned
            self.metrics.anchor_touches.labels(es.name, "late").inc()
            return 0
        except AdapterError as exc:
            self.metrics.anchor_touches.labels(es.name, "failed").inc()
            log.warning("anchor touch of %s failed: %s", anchor.agent, exc)
            return 0
        now = time.time()
        if now > anchor.last_used:  # (a call of its agent may have come in meanwhile)
            anchor.last_used, anchor.held = now, True
        es.signals.note_used(anchor.blocks[:resident], now)
        self.metrics.anchor_touches.labels(es.name, "ok").inc()
        self.metrics.touch_prompt_tokens.inc(result.prompt_tokens)
        self.metrics.touch_recomputed_tokens.inc(result.recomputed_tokens)
        return result.recomputed_tokens

    def view(self, engine: str, now: float, tenant: str | None = None) -> list[dict[str, Any]]:
        """The engine's learned anchors (of ``tenant`` only, when given) for the admin API."""
        demand = self.demand(now)
        return [
            {
                "tenant": owner,
                "agent": agent,
                "blocks": len(a.blocks),
                "demand": round(demand.get(AnchorId(owner, agent), 0.0), 3),
                "idle_s": round(max(0.0, now - a.last_used), 3),
            }
            for (owner, agent), a in self.anchors.get(engine, {}).items()
            if a.blocks and tenant in (None, owner)
        ]
