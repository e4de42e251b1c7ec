"""Which protected sessions to pin in the offload tier.

An LMCache tier behind the engine stores every prefill (write-through) and evicts by LRU, so
it keeps what was used last, not what will be back. Pins turn part of the tier into room for
the contexts kvkeeper knows will be back: the sessions it protects (a tool call outstanding, a
TTL) that the GPU has begun to lose (``proxy/tiers.py`` picks the candidates). A pinned
context's resume loads its prefix from the tier instead of recomputing it, so it needs no
keep-alive touches on the GPU.

Selection rule (:func:`plan_pins`): at most ``share`` x the tier's capacity in chunks is pinned;
sessions are taken soonest protection end first (the nearest resume: a TTL is a multiple of the
expected pause), then already pinned before new (no churn between equals), then larger first,
then by key; one that does not fit is skipped and smaller ones behind it may still fit. Chunks
two sessions share (an agent's system prompt) are counted for each: the budget is conservative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PinCandidate:
    """One protected session: its complete chunks, the protection left, whether it is pinned."""

    key: str
    chunks: int
    ttl_left_s: float
    pinned: bool = False


def pin_budget(capacity_chunks: int, share: float) -> int:
    """Chunks pins may hold: ``share`` of the tier's capacity."""
    if capacity_chunks <= 0 or share <= 0:
        return 0
    return int(capacity_chunks * min(share, 1.0))


def plan_pins(candidates: Sequence[PinCandidate], capacity_chunks: int, share: float) -> list[str]:
    """Keys to hold pinned, in selection order (module rule)."""
    budget = pin_budget(capacity_chunks, share)
    chosen: list[str] = []
    used = 0
    for c in sorted(candidates, key=lambda c: (c.ttl_left_s, not c.pinned, -c.chunks, c.key)):
        if c.chunks <= 0 or used + c.chunks > budget:
            continue
        chosen.append(c.key)
        used += c.chunks
    return chosen
