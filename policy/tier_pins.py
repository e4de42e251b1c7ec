"""Which protected sessions and agent anchors to pin in the offload tier.

An LMCache tier behind the engine stores every prefill (write-through) and evicts by LRU, so
it keeps what was used last, not what will be back. Pins turn part of the tier into room for
the contexts kvkeeper knows will be back: the sessions it protects (a tool call outstanding, a
TTL) that the GPU has begun to lose (``proxy/tiers.py`` picks the candidates). A pinned
context's resume loads its prefix from the tier instead of recomputing it, so it needs no
keep-alive touches on the GPU. Agent anchors (``retention.tier_pin_anchors``: an agent's system
prompt and tools, the prefix every call of that agent starts with) compete for the same room:
an LRU tier ages them out while the GPU serves them, so the call after the GPU lets one go
recomputes it unless it is pinned.

Selection rule (:func:`plan_pins`): at most ``share`` x the tier's capacity in chunks is pinned;
candidates are taken soonest expected next use first (Belady's order: a session's protection
left, a TTL being a multiple of the expected pause; an anchor's gap between calls of its agent),
then already pinned before new, then larger first, then by key; one that does not fit is
skipped and smaller ones behind it may still fit. A pinned candidate with a ``keep_factor`` k > 1
(anchors: a standing pin, where a session's pin ends at its resume) ranks as if due k times
sooner than it is: it gives its room up only to one due that much sooner (unpinned chunks leave
a small tier within seconds, so an anchor dropped for a candidate due a little sooner is gone
when it is wanted back). Sessions keep 1: their pins at 2 cost the traces 2.5 points of hit
rate and 12 of mean TTFT (BENCHMARKS.md). Chunks two candidates share (an agent's system
prompt inside a session's context) are counted for each: the budget is conservative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PinCandidate:
    """One session or anchor: its complete chunks, the seconds to its expected next use (a
    session's protection left, an anchor's gap between calls), whether it is pinned, and how
    much sooner than that it ranks while pinned."""

    key: str
    chunks: int
    next_use_s: float
    pinned: bool = False
    keep_factor: float = 1.0  # pinned, it ranks as if due this many times sooner


def anchor_next_use_s(call_gap_s: float, idle_s: float) -> float:
    """Seconds to an anchor's expected next use: the gap between calls of its agent, or the
    time since the last one once that is longer (an agent idle for long is not due soon)."""
    return max(call_gap_s, idle_s, 0.0)


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

    def rank(c: PinCandidate) -> tuple[float, bool, int, str]:
        due = c.next_use_s / c.keep_factor if c.pinned else c.next_use_s
        return due, not c.pinned, -c.chunks, c.key

    for c in sorted(candidates, key=rank):
        if c.chunks <= 0 or used + c.chunks > budget:
            continue
        chosen.append(c.key)
        used += c.chunks
    return chosen
