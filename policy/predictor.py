"""Next-agent predictor: an online first-order Markov model over agent identities (CacheScout).

Each dispatch ``prev -> next`` decays the row of ``prev`` by ``decay`` and adds one count, so
the model follows routing that changes over time at O(row) cost and bounded state. Predictions
are add-alpha smoothed over every known agent::

    P(next = j | prev = i) = (c_ij + alpha) / (sum_j c_ij + alpha * K)

An unknown or empty ``prev`` row falls back to the (equally decayed) marginal of next agents.
At most ``max_agents`` identities are kept; a new one beyond that replaces the least recently
seen. :meth:`TransitionModel.hop_distances` gives CacheScout's survival proxy: BFS hops over
transitions with probability >= ``min_prob`` (an anchor few hops away is reused soon).

The model is a small mutable object owned by one worker: deterministic, no clock, no I/O;
``to_state``/``from_state`` give a JSON-able snapshot for persistence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TransitionConfig:
    """``alpha``: smoothing pseudo-count; ``decay``: factor on a row's old counts per new
    observation of that row (1.0 = never forget); ``max_agents``: identities kept."""

    alpha: float = 0.1
    decay: float = 0.98
    max_agents: int = 256

    def __post_init__(self) -> None:
        if self.alpha <= 0 or not 0.0 < self.decay <= 1.0 or self.max_agents < 2:
            raise ValueError("need alpha > 0, 0 < decay <= 1, max_agents >= 2")


class TransitionModel:
    """Online first-order Markov chain over agent names."""

    def __init__(self, config: TransitionConfig | None = None) -> None:
        self.config = config or TransitionConfig()
        self._rows: dict[str, dict[str, float]] = {}
        self._marginal: dict[str, float] = {}
        self._last_seen: dict[str, int] = {}  # agent -> observation counter, for eviction
        self._clock = 0

    @property
    def agents(self) -> tuple[str, ...]:
        """Known agent identities, sorted."""
        return tuple(sorted(self._last_seen))

    def observe(self, prev_agent: str | None, next_agent: str) -> None:
        """One dispatch: ``next_agent`` ran after ``prev_agent`` (None = first of a workflow)."""
        self._clock += 1
        for agent in (prev_agent, next_agent):
            if agent is not None:
                self._touch_agent(agent)
        self._bump(self._marginal, next_agent)
        if prev_agent is not None:
            self._bump(self._rows.setdefault(prev_agent, {}), next_agent)

    def predict(self, prev_agent: str | None, top_k: int | None = None) -> list[tuple[str, float]]:
        """``[(agent, p)]`` over every known agent, most likely first (ties by name)."""
        row = self._row_for(prev_agent)
        total = sum(row.values())
        denom = total + self.config.alpha * len(self._last_seen)
        if denom <= 0:
            return []
        out = [(a, (row.get(a, 0.0) + self.config.alpha) / denom) for a in self._last_seen]
        out.sort(key=lambda ap: (-ap[1], ap[0]))
        return out if top_k is None else out[:top_k]

    def probability(self, prev_agent: str | None, next_agent: str) -> float:
        """Smoothed ``P(next_agent | prev_agent)``; 0.0 for an unknown ``next_agent``."""
        if next_agent not in self._last_seen:
            return 0.0
        row = self._row_for(prev_agent)
        denom = sum(row.values()) + self.config.alpha * len(self._last_seen)
        return (row.get(next_agent, 0.0) + self.config.alpha) / denom

    def hop_distances(
        self, current: str, min_prob: float = 0.2, max_hops: int = 8
    ) -> dict[str, int]:
        """agent -> fewest transitions (each with p >= ``min_prob``) from ``current`` to it."""
        dist: dict[str, int] = {}
        queue: deque[tuple[str, int]] = deque([(current, 0)])
        while queue:
            agent, hops = queue.popleft()
            if hops >= max_hops or agent not in self._rows:
                continue
            for nxt, p in self.predict(agent):
                if p < min_prob:
                    break  # predict() is sorted by p
                if nxt not in dist:
                    dist[nxt] = hops + 1
                    queue.append((nxt, hops + 1))
        return dist

    def to_state(self) -> dict[str, Any]:
        """JSON-able snapshot (counts, recency)."""
        return {
            "rows": {k: dict(v) for k, v in self._rows.items()},
            "marginal": dict(self._marginal),
            "last_seen": dict(self._last_seen),
            "clock": self._clock,
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], config: TransitionConfig | None = None
    ) -> TransitionModel:
        """Rebuild a model from :meth:`to_state`'s output."""
        model = cls(config)
        model._rows = {
            str(k): {str(a): float(c) for a, c in v.items()} for k, v in state["rows"].items()
        }
        model._marginal = {str(a): float(c) for a, c in state["marginal"].items()}
        model._last_seen = {str(a): int(t) for a, t in state["last_seen"].items()}
        model._clock = int(state["clock"])
        return model

    def _row_for(self, prev_agent: str | None) -> dict[str, float]:
        row = self._rows.get(prev_agent) if prev_agent is not None else None
        return row if row else self._marginal

    def _bump(self, row: dict[str, float], agent: str) -> None:
        decay = self.config.decay
        if decay < 1.0:
            for key in row:
                row[key] *= decay
        row[agent] = row.get(agent, 0.0) + 1.0

    def _touch_agent(self, agent: str) -> None:
        if agent not in self._last_seen and len(self._last_seen) >= self.config.max_agents:
            self._forget(min(self._last_seen, key=lambda a: (self._last_seen[a], a)))
        self._last_seen[agent] = self._clock

    def _forget(self, agent: str) -> None:
        # Rare (only when a new identity exceeds max_agents): O(K) over the rows.
        del self._last_seen[agent]
        self._rows.pop(agent, None)
        self._marginal.pop(agent, None)
        for row in self._rows.values():
            row.pop(agent, None)
