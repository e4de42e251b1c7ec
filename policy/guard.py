"""The retention guard: retention's own effect on one engine, measured online, and a back-off.

Retention spends engine work to buy cache hits: touches and warm-ups recompute prompt tokens,
and they queue in front of the clients' own requests; pins take room in the offload tier from
what LRU would have kept. Whether that pays depends on the workload, so the guard keeps a
running account per engine and stops retention where it does not:

* **cost**: the prompt tokens retention's requests made the engine recompute, each weighted by
  ``1 + queue_weight x`` the requests waiting at the engine when it was sent (a recompute in an
  idle engine delays nobody; in a queue it delays everyone behind it), plus ``load_weight`` per
  token a resume loaded from the tier (a load costs a fraction of a re-prefill);
* **bought**: the prompt tokens of resumes that hit because of retention: per resumed session
  it acted on since its previous request, the cached tokens up to what retention kept for it
  (the prefix a touch refreshed, the chunks a pin held), less what the same resume would have
  found without it. Plain LRU keeps a prefix for the engine's LRU horizon (``policy.horizon``),
  so a resume whose pause was shorter than the horizon would have hit anyway: retention bought
  it nothing (``within_horizon``, shown but not credited). Only a resume after a longer pause
  is credited what retention kept (less ``baseline``, a caller's estimate, 0 by default). An
  unknown horizon (no eviction seen) means LRU keeps everything: nothing is credited;
* **balance** = bought - cost, both sums decaying with half-life ``half_life_s``.

While the cost seen is below ``min_evidence_tokens`` the guard allows everything (no evidence
either way). Once it has evidence and the balance is negative it **backs off** for
``cooldown_s``: retention's own work (touches, warm-ups, new pins) stops on that engine. Each
back-off that follows a probe which did not pay doubles the cooldown (up to ``max_cooldown_s``);
a probe that ends with a positive balance resets it. After a cooldown the account starts again
from zero, so a workload that changed is measured afresh.

Pure: nothing here does I/O or reads a clock; ``now`` is always passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """``half_life_s``: how fast old cost and hits stop counting; ``min_evidence_tokens``: the
    weighted cost seen before the guard may judge; ``queue_weight``: cost per recomputed token
    per request waiting when it was sent; ``load_weight``: cost of a token loaded from the tier
    against one recomputed; ``cooldown_s`` / ``max_cooldown_s``: how long a back-off lasts."""

    enabled: bool = True
    half_life_s: float = 60.0
    min_evidence_tokens: float = 8192.0
    queue_weight: float = 1.0
    load_weight: float = 0.1
    cooldown_s: float = 30.0
    max_cooldown_s: float = 480.0

    def __post_init__(self) -> None:
        if self.half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        if self.min_evidence_tokens < 0:
            raise ValueError("min_evidence_tokens must be >= 0")
        if self.queue_weight < 0 or self.load_weight < 0:
            raise ValueError("queue_weight and load_weight must be >= 0")
        if not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ValueError("need 0 < cooldown_s <= max_cooldown_s")


def lru_would_have_kept(pause_s: float, horizon_s: float) -> bool:
    """Whether plain LRU would still hold a prefix last used ``pause_s`` ago on an engine whose
    unused blocks survive ``horizon_s`` (``inf``: unknown, nothing evicted yet)."""
    return pause_s < horizon_s


ACTIVE = "active"
BACKED_OFF = "backed_off"


class RetentionGuard:
    """One engine's account of what retention cost and what it bought (module docstring)."""

    __slots__ = (
        "_at",
        "_cooldown",
        "backoffs",
        "bought",
        "config",
        "cost",
        "resumes_credited",
        "resumes_within_horizon",
        "total_bought",
        "total_cost",
        "total_within_horizon",
        "until",
        "within_horizon",
    )

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config or GuardConfig()
        self.cost = 0.0  # decayed, weighted
        self.bought = 0.0  # decayed
        self.total_cost = 0.0  # undecayed, since start: for metrics
        self.total_bought = 0.0
        self.within_horizon = 0.0  # decayed: hits retention kept that LRU would have kept too
        self.total_within_horizon = 0.0
        self.resumes_credited = 0
        self.resumes_within_horizon = 0
        self.backoffs = 0
        self.until = -math.inf  # backed off until then
        self._cooldown = self.config.cooldown_s
        self._at: float | None = None  # when the sums were last decayed

    # --- the account ----------------------------------------------------------------------------
    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            f = 0.5 ** ((now - self._at) / self.config.half_life_s)
            self.cost *= f
            self.bought *= f
            self.within_horizon *= f
        if self._at is None or now > self._at:
            self._at = now

    def spend(self, recomputed_tokens: float, waiting: float, now: float) -> float:
        """Retention made the engine recompute ``recomputed_tokens`` while ``waiting`` requests
        waited there; the weighted cost added."""
        self._decay(now)
        c = max(0.0, recomputed_tokens) * (1.0 + self.config.queue_weight * max(0.0, waiting))
        self.cost += c
        self.total_cost += c
        return c

    def loaded(self, tier_tokens: float, now: float) -> float:
        """A resume loaded ``tier_tokens`` that retention kept in the tier; the cost added."""
        self._decay(now)
        c = max(0.0, tier_tokens) * self.config.load_weight
        self.cost += c
        self.total_cost += c
        return c

    def buy(self, hit_tokens: float, now: float, baseline: float = 0.0) -> float:
        """A resume hit ``hit_tokens`` that retention kept for it, of which ``baseline`` it
        would have hit anyway; the tokens credited."""
        self._decay(now)
        b = max(0.0, hit_tokens - max(0.0, baseline))
        self.bought += b
        self.total_bought += b
        return b

    def resume(
        self, hit_tokens: float, now: float, pause_s: float, horizon_s: float, baseline: float = 0.0
    ) -> float:
        """A resume after a pause of ``pause_s`` hit ``hit_tokens`` that retention kept for it,
        on an engine whose LRU horizon was ``horizon_s``: credited only beyond the horizon (within
        it LRU would have kept them); the tokens credited."""
        if hit_tokens <= 0:
            return 0.0
        if lru_would_have_kept(pause_s, horizon_s):
            self._decay(now)
            self.within_horizon += hit_tokens
            self.total_within_horizon += hit_tokens
            self.resumes_within_horizon += 1
            return 0.0
        self.resumes_credited += 1
        return self.buy(hit_tokens, now, baseline)

    def balance(self, now: float) -> float:
        self._decay(now)
        return self.bought - self.cost

    # --- the decision ---------------------------------------------------------------------------
    @property
    def cooldown_s(self) -> float:
        return self._cooldown

    def state(self, now: float) -> str:
        return BACKED_OFF if now < self.until else ACTIVE

    def allows(self, now: float) -> bool:
        """Whether retention may spend on this engine now (judging the account first)."""
        if not self.config.enabled:
            return True
        if now < self.until:
            return False
        if self.until > -math.inf:  # a cooldown just ended: measure afresh
            self.until = -math.inf
            self.cost = self.bought = self.within_horizon = 0.0
            self._at = now
        self._decay(now)
        if self.cost < self.config.min_evidence_tokens:
            return True
        if self.bought >= self.cost:
            self._cooldown = self.config.cooldown_s  # it paid: the next back-off starts short
            return True
        self.until = now + self._cooldown
        self.backoffs += 1
        self._cooldown = min(self.config.max_cooldown_s, 2 * self._cooldown)
        return False

    def view(self, now: float) -> dict[str, Any]:
        """What ``/admin/engines`` shows."""
        self._decay(now)
        return {
            "state": self.state(now),
            "balance_tokens": round(self.bought - self.cost, 1),
            "cost_tokens": round(self.cost, 1),
            "bought_tokens": round(self.bought, 1),
            "total_cost_tokens": round(self.total_cost, 1),
            "total_bought_tokens": round(self.total_bought, 1),
            "within_horizon_tokens": round(self.within_horizon, 1),
            "total_within_horizon_tokens": round(self.total_within_horizon, 1),
            "resumes_credited": self.resumes_credited,
            "resumes_within_horizon": self.resumes_within_horizon,
            "backoffs": self.backoffs,
            "backed_off_for_s": round(max(0.0, self.until - now), 1),
            "next_cooldown_s": self._cooldown,
        }
