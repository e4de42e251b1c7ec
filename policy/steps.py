"""How long the engine's steps are, from a latency histogram read twice (pure).

A keep-alive touch that reaches the engine during a step waits for the rest of it and is served
in the next, so how long a touch may take before it is called late depends on the engine's steps:
milliseconds on a GPU, seconds on a CPU engine prefilling a long prompt. vLLM exports no step
histogram, but a request waits one step between two output tokens (``inter_token_latency``),
and one or more from its scheduling to its first token (``request_prefill_time``).

A touch arrives at a random moment, so what it meets is a step drawn by *time*, not by count: a
2 s prefill step among twenty 50 ms decode steps is 5% of the steps but two thirds of the time.
:func:`step_seconds` is therefore the time-weighted quantile of the latencies observed between
two readings of a cumulative Prometheus histogram, interpolated within its bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# (upper bound ``le``, cumulative count) per bucket, ``math.inf`` last, as Prometheus exposes them
Buckets = Sequence[tuple[float, float]]


def window_counts(before: Buckets | None, after: Buckets) -> list[tuple[float, float, float]]:
    """``(low, high, count)`` per bucket of the observations made between the two readings;
    [] when the histogram went back (an engine restart) or its buckets changed."""
    bounds = [le for le, _ in after]
    prev = dict(before) if before is not None else {}
    if before is not None and [le for le, _ in before] != bounds:
        return []
    out: list[tuple[float, float, float]] = []
    low, cum_before, cum_after = 0.0, 0.0, 0.0
    for le, cum in after:
        was = prev.get(le, 0.0)
        count = (cum - cum_after) - (was - cum_before)
        if count < 0:
            return []
        out.append((low, le, count))
        low, cum_before, cum_after = le, was, cum
    return out


def step_seconds(counts: Sequence[tuple[float, float, float]], q: float = 0.9) -> float | None:
    """The time-weighted ``q`` quantile of the latencies in ``counts`` (``window_counts``): the
    step length that ``q`` of the engine's time was spent in steps no longer than. None when
    nothing was observed. An observation in the open last bucket counts as twice its low bound."""
    weighted: list[tuple[float, float, float]] = []
    for low, high, n in counts:
        if n <= 0:
            continue
        top = high if math.isfinite(high) else 2.0 * low
        weighted.append((low, top, n * (low + top) / 2.0))
    total = sum(w for _, _, w in weighted)
    if total <= 0:
        return None
    target, running = q * total, 0.0
    for low, top, w in weighted:
        if running + w >= target:
            return low + (top - low) * (target - running) / w
        running += w
    return weighted[-1][1]
