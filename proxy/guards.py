"""The retention guard per engine, fed from the request path and retention's own requests.

:mod:`policy.guard` keeps the account; this module feeds it and exports it:

* ``spent``: a touch or warm-up ended, having made the engine recompute that many tokens while
  that many requests waited there;
* ``kept``: retention acted on a session (a touch refreshed its first N tokens, a warm-up
  brought them back, a pin held them in the tier);
* ``resumed``: the session's next request was served with that many cached tokens: what
  retention kept of them is credited (once per act) when the pause since its previous request
  outlasted the engine's LRU horizon (shorter, LRU would have kept them: not credited), a tier
  load charged at its weight;
* ``allows``: whether retention may spend on the engine now (touches, warm-ups, new pins).

Metrics: ``kvkeeper_retention_guard_*`` per engine; ``view`` is the ``guard`` entry of
``/admin/engines``. With several workers the leader's account is an estimate (``workers``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from policy.guard import BACKED_OFF, GuardConfig, RetentionGuard
from proxy.keys import SessionKey as Key
from proxy.metrics import Metrics
from proxy.settings import GuardSettings

# sessions whose last request time the guard remembers (the oldest forgotten first)
MAX_SEEN = 65536


@dataclass(slots=True)
class _Kept:
    tokens: int  # leading prompt tokens retention kept for the session
    tier: bool  # held in the offload tier (a resume loads them) rather than on the GPU


def guard_config(settings: GuardSettings) -> GuardConfig:
    return GuardConfig(
        enabled=settings.enabled,
        half_life_s=settings.half_life_s,
        min_evidence_tokens=settings.min_evidence_tokens,
        queue_weight=settings.queue_weight,
        cooldown_s=settings.cooldown_s,
        max_cooldown_s=16 * settings.cooldown_s,
    )


class Guards:
    """One :class:`RetentionGuard` per engine, and what retention kept for which session."""

    def __init__(self, settings: GuardSettings, metrics: Metrics, workers: int = 1) -> None:
        self.config = guard_config(settings)
        # with several ``serve`` workers the one that drives retention sees only the resumes
        # its own connections carry (about 1/workers of them, spread by SO_REUSEPORT), and all
        # of retention's cost: what it sees bought stands for that many times as much
        self.workers = max(1, workers)
        self.metrics = metrics
        self._guards: dict[str, RetentionGuard] = {}
        self._kept: dict[str, dict[Key, _Kept]] = {}
        self._backoffs: dict[str, int] = {}
        # when each session's last request ended: a touch refreshes the store's last_active,
        # but the pause LRU had to survive runs from the client's own last request
        self._seen: dict[Key, float] = {}

    def configure(self, config: GuardConfig) -> None:
        """Start every engine's account afresh under ``config`` (tests, tuning)."""
        self.config = config
        self._guards.clear()
        self._kept.clear()
        self._backoffs.clear()

    def of(self, engine: str) -> RetentionGuard:
        guard = self._guards.get(engine)
        if guard is None:
            guard = self._guards[engine] = RetentionGuard(self.config)
            self._kept[engine] = {}
            self._backoffs[engine] = 0
        return guard

    def allows(self, engine: str, now: float) -> bool:
        guard = self.of(engine)
        allowed = guard.allows(now)
        if guard.backoffs > self._backoffs[engine]:
            self.metrics.guard_backoffs.labels(engine).inc(guard.backoffs - self._backoffs[engine])
            self._backoffs[engine] = guard.backoffs
        self._export(engine, now)
        return allowed

    def spent(self, engine: str, recomputed: int, waiting: float, now: float) -> None:
        cost = self.of(engine).spend(recomputed, waiting, now)
        if cost > 0:
            self.metrics.guard_cost.labels(engine).inc(cost)
        self._export(engine, now)

    def kept(self, engine: str, key: Key, tokens: int, *, tier: bool = False) -> None:
        """Retention kept the session's first ``tokens`` prompt tokens (the largest act since
        its last request counts)."""
        self.of(engine)
        book = self._kept[engine]
        held = book.get(key)
        if held is None or tokens >= held.tokens:
            book[key] = _Kept(max(0, tokens), tier)

    def resumed(
        self,
        engine: str,
        key: Key,
        cached_tokens: int,
        now: float,
        *,
        horizon_s: float = math.inf,
        last_active: float = 0.0,
        horizon_of: Callable[[float], float] | None = None,
    ) -> int:
        """The session's next request found ``cached_tokens`` on an engine whose LRU horizon
        is ``horizon_s`` (or ``horizon_of(now)``, asked only when something was kept for the
        session); ``last_active``: the store's last activity of the session (used when this
        process did not see its previous request). The tokens credited."""
        since = self._seen.pop(key, None)
        self._seen[key] = now
        if len(self._seen) > MAX_SEEN:
            del self._seen[next(iter(self._seen))]
        book = self._kept.get(engine)
        held = book.pop(key, None) if book is not None else None
        if held is None:
            return 0
        guard = self.of(engine)
        hit = min(max(0, cached_tokens), held.tokens)
        if held.tier and hit:
            self.metrics.guard_cost.labels(engine).inc(guard.loaded(hit, now))
        if horizon_of is not None:
            horizon_s = horizon_of(now)
        since = since if since is not None else last_active
        pause = now - since if since > 0 else math.inf
        within = guard.resumes_within_horizon
        bought = int(guard.resume(hit * self.workers, now, pause, horizon_s))
        if bought:
            self.metrics.guard_bought.labels(engine).inc(bought)
        elif guard.resumes_within_horizon > within:
            self.metrics.guard_within_horizon.labels(engine).inc(hit * self.workers)
        self._export(engine, now)
        return bought

    def forget(self, key: Key) -> None:
        """The session ended: whatever was kept for it bought nothing more."""
        for book in self._kept.values():
            book.pop(key, None)
        self._seen.pop(key, None)

    def _export(self, engine: str, now: float) -> None:
        guard = self._guards[engine]
        self.metrics.guard_balance.labels(engine).set(guard.balance(now))
        self.metrics.guard_backed_off.labels(engine).set(int(guard.state(now) == BACKED_OFF))

    def view(self, engine: str, now: float) -> dict[str, Any]:
        out = self.of(engine).view(now)
        out["enabled"] = self.config.enabled
        out["workers_scale"] = self.workers
        out["sessions_kept"] = len(self._kept.get(engine, {}))
        return out
