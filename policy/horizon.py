"""LRU horizon: how long an unused prefix block currently survives on an engine.

vLLM evicts the least-recently-freed cached block first, so every evicted block whose last use
kvkeeper knows reveals one sample of the horizon: ``age = removed_at - last_used_at``. The
estimate is a low weighted quantile of a bounded window of recent samples, each weighted by an
exponential decay of its age, so the estimate follows pressure changes but one burst of odd
samples does not dominate it.

Without KV events the estimator falls back to ``cached_tokens`` feedback: a session resumed after
an idle gap ``g`` with fewer cached tokens than expected proves that the horizon is below ``g``.
Touches happen at a fraction of the estimate, so each further loss lowers the bound until
resumes stop losing tokens.

When evictions stop, old samples keep their relative weights: the estimate does not drift towards
"infinite", because a touch costs about one token while a lost prefix costs all of them.

This module is pure: no clock is read (``now``/``at`` are arguments) and nothing does I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class HorizonSource(StrEnum):
    """Where a horizon estimate comes from."""

    EVENTS = "events"  # BlockRemoved ages
    FEEDBACK = "feedback"  # cached_tokens shortfalls on resume
    UNKNOWN = "unknown"  # no eviction seen yet: the horizon is unbounded


@dataclass(frozen=True, slots=True)
class HorizonConfig:
    """Tuning of :class:`HorizonEstimator`.

    ``window``: most recent samples kept per kind; ``quantile``: the low quantile taken (0.1 =
    90% of recent evictions were older than the estimate); ``half_life_s``: decay of a sample's
    weight with its age; ``min_samples``: below this many samples the minimum is used instead of
    the quantile (a quantile of three points means nothing).
    """

    window: int = 256
    quantile: float = 0.1
    half_life_s: float = 300.0
    min_samples: int = 8

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError("quantile must be within [0, 1]")
        if self.half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")


@dataclass(frozen=True, slots=True)
class HorizonEstimate:
    """The current horizon: ``seconds`` is ``math.inf`` when ``source`` is UNKNOWN."""

    seconds: float
    source: HorizonSource
    samples: int

    @property
    def known(self) -> bool:
        return math.isfinite(self.seconds)


UNKNOWN_HORIZON = HorizonEstimate(math.inf, HorizonSource.UNKNOWN, 0)


def weighted_quantile(
    samples: Iterable[tuple[float, float]], q: float, now: float, half_life_s: float
) -> float:
    """The ``q`` quantile of ``(at, value)`` samples weighted by ``0.5 ** ((now - at) / half_life)``.

    Returns ``math.inf`` for no samples. O(n log n).
    """
    weighted = sorted((value, 0.5 ** (max(0.0, now - at) / half_life_s)) for at, value in samples)
    if not weighted:
        return math.inf
    target = q * sum(w for _, w in weighted)
    running = 0.0
    for value, w in weighted:
        running += w
        if running >= target:
            return value
    return weighted[-1][0]


class HorizonEstimator:
    """Bounded online horizon estimate for one engine; owned by its retention worker."""

    def __init__(self, config: HorizonConfig | None = None) -> None:
        self.config = config or HorizonConfig()
        self._evictions: deque[tuple[float, float]] = deque(maxlen=self.config.window)
        self._losses: deque[tuple[float, float]] = deque(maxlen=self.config.window)
        self.survivals = 0  # resumes that found their whole prefix cached (informational)
        # the last estimate, until a sample arrives: decay scales every weight alike, so the
        # quantile of unchanged samples does not move with ``now`` (past their newest sample)
        self._changes = 0
        self._memo: tuple[int, float, HorizonEstimate] | None = None  # (changes, newest, est.)

    def observe_eviction(self, age_s: float, at: float) -> None:
        """One evicted block, unused for ``age_s`` seconds when it was removed at ``at``."""
        if age_s >= 0 and math.isfinite(age_s):
            self._evictions.append((at, age_s))
            self._changes += 1

    def observe_evictions(self, ages_s: Iterable[float], at: float) -> None:
        """All blocks of one BlockRemoved event (or one tick's batch) removed at ``at``.

        Only the newest ``window`` valid ages can stay, so a long prompt's thousands of
        evictions are walked from the end and the rest skipped.
        """
        kept: list[tuple[float, float]] = []
        for age in reversed(ages_s if isinstance(ages_s, Sequence) else list(ages_s)):
            if age >= 0 and math.isfinite(age):
                kept.append((at, age))
                if len(kept) == self.config.window:
                    break
        self._evictions.extend(reversed(kept))
        self._changes += bool(kept)

    def observe_resume(
        self, gap_s: float, cached_tokens: int, expected_cached_tokens: int, at: float
    ) -> bool:
        """Feedback from one resumed session; returns True when it revealed a loss.

        ``gap_s`` is the time since the session's prefix was last used OR touched;
        ``expected_cached_tokens`` is what a fully resident prefix would have given (whole blocks
        of the previous context). A shortfall bounds the horizon below ``gap_s``.
        """
        if cached_tokens < expected_cached_tokens and gap_s > 0:
            self._losses.append((at, gap_s))
            self._changes += 1
            return True
        self.survivals += 1
        return False

    def estimate(self, now: float) -> HorizonEstimate:
        """The horizon as of ``now``: events first, else feedback, else unknown (infinite)."""
        memo = self._memo
        if memo is not None and memo[0] == self._changes and now >= memo[1]:
            return memo[2]
        samples, source = self._evictions, HorizonSource.EVENTS
        if not samples:
            samples, source = self._losses, HorizonSource.FEEDBACK
        if not samples:
            return UNKNOWN_HORIZON
        found = HorizonEstimate(self._robust(samples, now), source, len(samples))
        self._memo = (self._changes, max(at for at, _ in samples), found)
        return found

    def _robust(self, samples: deque[tuple[float, float]], now: float) -> float:
        # Too few samples for a quantile: the smallest seen is the safe choice.
        if len(samples) < self.config.min_samples:
            return min(value for _, value in samples)
        return weighted_quantile(samples, self.config.quantile, now, self.config.half_life_s)


class RateMeter:
    """Events per second over a sliding window, from timestamped counts; no clock read.

    A window, not an exponential average: an EWMA starts near zero and would report a slow
    allocation rate (hence a long, unsafe horizon) for its whole warm-up. Over less than
    ``min_span_s`` of history the span is taken as ``min_span_s``.
    """

    def __init__(self, window_s: float = 10.0, min_span_s: float = 1.0) -> None:
        if window_s <= 0 or min_span_s <= 0:
            raise ValueError("window_s and min_span_s must be > 0")
        self._window = window_s
        self._min_span = min_span_s
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0
        self._first: float | None = None

    def add(self, count: float, at: float) -> None:
        """``count`` events observed at time ``at`` (non-decreasing)."""
        if self._first is None:
            self._first = at
        self._events.append((at, count))
        self._sum += count
        self._trim(at)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self._window:
            self._sum -= self._events.popleft()[1]

    def rate(self, now: float) -> float:
        """Events per second over the window ending at ``now``."""
        self._trim(now)
        if self._first is None or not self._events:
            return 0.0
        span = now - max(self._first, now - self._window)
        return self._sum / max(span, self._min_span)


def fill_time_horizon(free_blocks: float, store_rate: float) -> float:
    """How long a block freed now survives: the free queue ahead of it over the allocation rate.

    vLLM appends freed blocks to the tail of its free queue and allocates from the head, so a
    block freed now is reused after roughly ``free_blocks`` new allocations; newly stored blocks
    per second (BlockStored events) measure that allocation rate. ``inf`` when nothing is being
    allocated.
    """
    if store_rate <= 0 or free_blocks <= 0:
        return math.inf if store_rate <= 0 else 0.0
    return free_blocks / store_rate
