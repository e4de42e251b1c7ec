"""Protection for sessions that came back without asking for it.

A chat conversation's turn ends without a tool call, so its client sends no TTL, and LRU keeps
a freed prefix only for the engine's horizon (seconds under load), while conversations return
minutes apart. Which ones will return is not known, but one that has returned once is more
likely to again (Mooncake trace: 21-22% of conversations return after their first turn, 28-56%
after a later one), and protecting every conversation would spread the pool over the 80% that
never do. So a session that returns without a TTL is protected for ``factor`` x the median
pause seen before a session's first return, learned online from those pauses.

Rule (:class:`ReturnWindow`): ``observe`` records the pause of a session's first return (the
caller feeds first returns only: later pauses are shortened by the touches the protection
itself causes); ``ttl`` is None until ``min_samples`` pauses are known, then
``clamp(factor x median of the last max_samples pauses, min_ttl_s, max_ttl_s)``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReturnWindowConfig:
    """``factor``: protection as a multiple of the median first-return pause (0: off);
    ``min_samples``: pauses needed before protecting; ``max_samples``: pauses remembered."""

    factor: float = 2.0
    min_samples: int = 8
    max_samples: int = 256
    min_ttl_s: float = 1.0
    max_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.factor >= 0 or not math.isfinite(self.factor):
            raise ValueError("factor must be finite and >= 0")
        if self.min_samples < 1 or self.max_samples < self.min_samples:
            raise ValueError("min_samples must be within [1, max_samples]")
        if not 0 < self.min_ttl_s <= self.max_ttl_s:
            raise ValueError("min_ttl_s must be within (0, max_ttl_s]")


class ReturnWindow:
    """The learned protection of returning sessions (module rule)."""

    def __init__(self, config: ReturnWindowConfig | None = None) -> None:
        self.config = config or ReturnWindowConfig()
        self._pauses: deque[float] = deque(maxlen=self.config.max_samples)
        self._ttl: float | None = None  # recomputed on observe: ttl() is on the request path

    @property
    def samples(self) -> int:
        return len(self._pauses)

    def observe(self, pause_s: float) -> None:
        """A session's first return came ``pause_s`` after its previous request."""
        if math.isfinite(pause_s) and pause_s >= 0:
            self._pauses.append(pause_s)
            c, median = self.config, self.median()
            if c.factor > 0 and median is not None and len(self._pauses) >= c.min_samples:
                self._ttl = min(max(c.factor * median, c.min_ttl_s), c.max_ttl_s)

    def median(self) -> float | None:
        if not self._pauses:
            return None
        ordered = sorted(self._pauses)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    def ttl(self) -> float | None:
        """Seconds to protect a returning session for (None: off, or not learned yet)."""
        return self._ttl
