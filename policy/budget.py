"""The soft-TTL budget: how many blocks protections may hold, and which protections lapse.

The RFC's allocation order (A: ordinary free -> B: session-associated -> C: TTL-protected) is
realised from outside the engine by refreshing at most a budget of protected blocks; protections
beyond it are simply not refreshed, so LRU takes them first (reported as ``pressure_override``).
Hints therefore can never cause an OOM or hold the pool against ordinary traffic.

Budget rule (:func:`effective_budget`)::

    base      = share * pool_blocks
    usage_p   = clamp((kv_cache_usage - usage_high) / (1 - usage_high), 0, 1)
    waiting_p = clamp(waiting / max(running, 1), 0, 1)   # a queue as long as the batch = full
    pressure  = max(usage_p, waiting_p)
    budget    = floor(base * (1 - pressure * (1 - min_factor)))

``kv_cache_usage`` is vLLM's share of blocks held by running requests (cached-but-free blocks,
where protected prefixes live, count as free), so high usage or a waiting queue means ordinary
traffic needs the space: the budget shrinks to ``min_factor * base`` at full pressure.

Selection rule (:func:`allocate_budget`): sessions the client protected (a TTL it asked for)
are admitted before ``guessed`` ones (protected by kvkeeper's guess, ``policy.returns``), so a
guess only takes the budget the client's protections leave; within each, most valuable first
(then fewer blocks, then id). Each costs only the blocks not already admitted (blocks shared by
several live sessions count once); one that does not fit lapses, and smaller ones behind it may
still fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policy.ids import SessionId


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    """``share``: fraction of the pool protections may hold at no pressure; ``usage_high``: usage
    above which the budget starts to shrink; ``min_factor``: budget fraction left at full
    pressure (0 = protections vanish entirely under pressure)."""

    share: float = 0.5
    usage_high: float = 0.85
    min_factor: float = 0.1

    def __post_init__(self) -> None:
        for name in ("share", "min_factor"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if not 0.0 <= self.usage_high < 1.0:
            raise ValueError("usage_high must be within [0, 1)")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine reports this tick (None = not exposed, counted as no pressure)."""

    pool_blocks: int
    kv_cache_usage: float | None = None
    waiting: float | None = None
    running: float | None = None

    @property
    def free_blocks(self) -> float:
        """Blocks no running request holds (cached-but-free ones included)."""
        return self.pool_blocks * (1.0 - (self.kv_cache_usage or 0.0))


@dataclass(frozen=True, slots=True)
class BudgetSession:
    """A protected session competing for the budget: its block ids (hashes), value, and
    whether its protection is kvkeeper's guess rather than the client's."""

    session_id: SessionId
    block_ids: tuple[int, ...]
    value: float
    guessed: bool = False


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    """``keep``: protections refreshed; ``pressure_override``: protections that lapse (least
    valuable first order); ``protected_blocks``: distinct blocks kept; ``budget_blocks``: the
    budget used; ``pressure``: the pressure in [0, 1] that shrank it."""

    keep: tuple[SessionId, ...]
    pressure_override: tuple[SessionId, ...]
    protected_blocks: int
    budget_blocks: int
    pressure: float


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def load_pressure(load: EngineLoad, config: BudgetConfig) -> float:
    """Pressure in [0, 1] from usage above ``usage_high`` and the waiting queue (module rule)."""
    usage_p = 0.0
    if load.kv_cache_usage is not None:
        usage_p = _clamp01((load.kv_cache_usage - config.usage_high) / (1.0 - config.usage_high))
    waiting_p = 0.0
    if load.waiting:
        waiting_p = _clamp01(load.waiting / max(load.running or 0.0, 1.0))
    return max(usage_p, waiting_p)


def effective_budget(load: EngineLoad, config: BudgetConfig | None = None) -> tuple[int, float]:
    """``(budget_blocks, pressure)`` for this tick (module rule)."""
    cfg = config or BudgetConfig()
    pressure = load_pressure(load, cfg)
    base = cfg.share * max(0, load.pool_blocks)
    # Interpolated as a blend (not 1 - p * (1 - f)) so p = 1 gives exactly f * base; the
    # epsilon keeps a product like 275.0000001 or 49.9999999 on the intended integer.
    blocks = base * ((1.0 - pressure) + pressure * cfg.min_factor)
    return math.floor(blocks + 1e-6), pressure


def allocate_budget(
    sessions: Sequence[BudgetSession], budget_blocks: int, pressure: float = 0.0
) -> BudgetDecision:
    """Keep the client's protections, then the guessed ones, most valuable first, within
    ``budget_blocks`` distinct blocks.

    O(n log n + total block ids). Shared blocks are charged to the first admitted holder only.
    """
    order = sorted(sessions, key=lambda s: (s.guessed, -s.value, len(s.block_ids), s.session_id))
    admitted: set[int] = set()
    keep: list[SessionId] = []
    lapsed: list[SessionId] = []
    for s in order:
        new = {b for b in s.block_ids if b not in admitted}
        if len(admitted) + len(new) <= budget_blocks:
            admitted |= new
            keep.append(s.session_id)
        else:
            lapsed.append(s.session_id)
    lapsed.reverse()  # least valuable first
    return BudgetDecision(tuple(keep), tuple(lapsed), len(admitted), budget_blocks, pressure)


def plan_budget(
    sessions: Sequence[BudgetSession], load: EngineLoad, config: BudgetConfig | None = None
) -> BudgetDecision:
    """:func:`effective_budget` then :func:`allocate_budget`: the whole tick in one call."""
    budget, pressure = effective_budget(load, config)
    return allocate_budget(sessions, budget, pressure)


def session_value(
    n_blocks: int, p_resume: float, expected_wait_s: float, min_wait_s: float = 1.0
) -> float:
    """Expected reuse savings per second of holding: ``n_blocks * p_resume / expected_wait``.

    ``p_resume``: probability the session resumes before its TTL (from the gap model);
    ``expected_wait_s``: expected time until it does; floored at ``min_wait_s`` so an imminent
    resume does not get an unbounded value.
    """
    return max(0, n_blocks) * _clamp01(p_resume) / max(expected_wait_s, min_wait_s)
