"""Which protected sessions to pin in the offload tier.

An LMCache tier behind the engine stores every prefill (write-through) and evicts by LRU, so
it keeps what was used last, not what will be back. Pins turn part of the tier into room for
the contexts kvkeeper knows will be back: the sessions it protects (a tool call outstanding, a
TTL) that the GPU has begun to lose (``proxy/tiers.py`` picks the candidates). A pinned
context's resume loads its prefix from the tier instead of recomputing it, so it needs no
keep-alive touches on the GPU.

Selection rule (:func:`plan_pins`): at most ``share`` x the tier's capacity in chunks is pinned;
sessions the client protected are taken before ``guessed`` ones (kvkeeper's guess,
``policy.returns``: a guess only gets the room the client's protections leave); within each,
soonest expected next use first (Belady's order: a session's protection left), then already
pinned before new, then larger first, then by key; one that does not fit
is skipped and smaller ones behind it may still fit. Chunks two candidates share are counted
for each: the budget is conservative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", str, tuple[str, str])  # a candidate's key: a name, or (tenant, session)


@dataclass(frozen=True, slots=True)
class PinCandidate(Generic[K]):
    """One session: its complete chunks, the seconds to its expected next use (its protection
    left), whether it is pinned, and whether its protection is a guess."""

    key: K
    chunks: int
    next_use_s: float
    pinned: bool = False
    guessed: bool = False


def pin_budget(capacity_chunks: int, share: float) -> int:
    """Chunks pins may hold: ``share`` of the tier's capacity."""
    if capacity_chunks <= 0 or share <= 0:
        return 0
    return int(capacity_chunks * min(share, 1.0))


def plan_pins(candidates: Sequence[PinCandidate[K]], capacity_chunks: int, share: float) -> list[K]:
    """Keys to hold pinned, in selection order (module rule)."""
    budget = pin_budget(capacity_chunks, share)
    chosen: list[K] = []
    used = 0
    for c in sorted(
        candidates, key=lambda c: (c.guessed, c.next_use_s, not c.pinned, -c.chunks, c.key)
    ):
        if c.chunks <= 0 or used + c.chunks > budget:
            continue
        chosen.append(c.key)
        used += c.chunks
    return chosen
