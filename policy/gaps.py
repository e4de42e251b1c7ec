"""Gap model: how long until an idle session resumes, per (agent, stop reason).

A session that stopped (``tool_calls``, ``stop``, ``length``...) either resumes after a gap or
never does. The model keeps, per key, an exponentially decayed log-normal fit of observed gaps
(weighted count, sum and sum of squares of ``log(gap)``) and decayed counts of resumes versus
abandons (sessions that ended or expired without resuming)::

    P(resume within t) = p_return * LogNormal(mu, sigma).cdf(t)
    p_return = (returns + 1) / (returns + abandons + 2)

A key with fewer than ``min_samples`` weighted gaps falls back to (agent, any reason), then
(any agent, reason), then (any, any), then the configured prior. Every observation updates all
four levels, so the fallbacks are always current.

Deterministic, no clock, no I/O; log-normal maths via ``statistics.NormalDist``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

ANY = "*"
_STD = NormalDist()
_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class GapDistribution:
    """Time until resume: log-normal ``(mu, sigma)`` of ``log(seconds)`` given a return, and
    ``p_return``, the probability of a return at all; ``samples``: weighted gaps behind it."""

    mu: float
    sigma: float
    p_return: float
    samples: float = 0.0

    def cdf(self, t: float) -> float:
        """P(gap <= t | the session returns)."""
        if t <= 0:
            return 0.0
        return _STD.cdf((math.log(t) - self.mu) / self.sigma)

    def p_resume_within(self, t: float, elapsed: float = 0.0) -> float:
        """P(resume within the next ``t`` s | not resumed during the first ``elapsed`` s)."""
        f_e = self.cdf(elapsed)
        alive = 1.0 - self.p_return * f_e  # not resumed yet (includes "never")
        if alive <= _EPS or t <= 0:
            return 0.0
        return min(1.0, self.p_return * (self.cdf(elapsed + t) - f_e) / alive)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the gap given a return."""
        q = min(max(q, _EPS), 1.0 - _EPS)
        return math.exp(self.mu + self.sigma * _STD.inv_cdf(q))

    def median_remaining(self, elapsed: float = 0.0) -> float:
        """Median time still to wait, given a return and none during the first ``elapsed`` s."""
        f_e = self.cdf(elapsed)
        return max(0.0, self.quantile(f_e + 0.5 * (1.0 - f_e)) - elapsed)

    def expected_wait_within(self, window: float, elapsed: float = 0.0) -> float:
        """E[min(time to resume, window)] given no resume during the first ``elapsed`` s.

        Sessions that never return wait the whole window. Closed form, via the log-normal's
        partial expectation ``E[T; a < T <= b] = exp(mu + sigma^2 / 2) * (Phi(zb') - Phi(za'))``
        with ``z' = (log x - mu - sigma^2) / sigma``.
        """
        if window <= 0:
            return 0.0
        end = elapsed + window
        f_e, f_end = self.cdf(elapsed), self.cdf(end)
        alive = 1.0 - self.p_return * f_e
        if alive <= _EPS:
            return 0.0
        returning = self._partial_mean(elapsed, end) - elapsed * (f_end - f_e)
        returning += window * (1.0 - f_end)
        return (self.p_return * returning + (1.0 - self.p_return) * window) / alive

    def _partial_mean(self, a: float, b: float) -> float:
        def phi(x: float) -> float:
            if x <= 0:
                return 0.0
            return _STD.cdf((math.log(x) - self.mu - self.sigma**2) / self.sigma)

        return math.exp(self.mu + 0.5 * self.sigma**2) * (phi(b) - phi(a))


@dataclass(frozen=True, slots=True)
class GapConfig:
    """``decay``: weight kept by old statistics per new observation of a key; ``min_samples``:
    weighted gaps needed before a key is trusted; ``prior_*``: the answer with no data;
    ``min_sigma``: floor so one repeated gap does not give a zero-width fit; ``max_keys``:
    bound on (agent, reason) keys (least recently updated dropped first)."""

    decay: float = 0.95
    min_samples: float = 3.0
    prior_median_s: float = 30.0
    prior_sigma: float = 1.0
    prior_p_return: float = 0.5
    min_sigma: float = 0.1
    max_keys: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0 or self.prior_median_s <= 0 or self.min_sigma <= 0:
            raise ValueError("need 0 < decay <= 1, prior_median_s > 0, min_sigma > 0")
        if self.max_keys < 4:
            raise ValueError("max_keys must be >= 4 (one observation updates four keys)")

    @property
    def prior(self) -> GapDistribution:
        return GapDistribution(math.log(self.prior_median_s), self.prior_sigma, self.prior_p_return)


@dataclass(slots=True)
class _Stats:
    weight: float = 0.0  # decayed count of gaps
    sum_log: float = 0.0
    sum_log2: float = 0.0
    returns: float = 0.0
    abandons: float = 0.0

    def decay(self, factor: float) -> None:
        self.weight *= factor
        self.sum_log *= factor
        self.sum_log2 *= factor
        self.returns *= factor
        self.abandons *= factor


class GapModel:
    """Online per-(agent, stop reason) gap estimates; owned by one worker."""

    def __init__(self, config: GapConfig | None = None) -> None:
        self.config = config or GapConfig()
        self._stats: dict[tuple[str, str], _Stats] = {}

    def __len__(self) -> int:
        """Number of (agent, stop reason) keys tracked, wildcard levels included."""
        return len(self._stats)

    def observe(self, agent: str, stop_reason: str, gap_s: float) -> None:
        """A session of ``agent`` that stopped with ``stop_reason`` resumed after ``gap_s``."""
        log_gap = math.log(max(gap_s, 1e-3))
        for stats in self._levels(agent, stop_reason):
            stats.decay(self.config.decay)
            stats.weight += 1.0
            stats.sum_log += log_gap
            stats.sum_log2 += log_gap * log_gap
            stats.returns += 1.0

    def observe_abandon(self, agent: str, stop_reason: str) -> None:
        """A session ended or expired without resuming after stopping with ``stop_reason``."""
        for stats in self._levels(agent, stop_reason):
            stats.decay(self.config.decay)
            stats.abandons += 1.0

    def distribution(self, agent: str, stop_reason: str) -> GapDistribution:
        """The most specific trusted fit for this key (module fallback chain)."""
        for key in ((agent, stop_reason), (agent, ANY), (ANY, stop_reason), (ANY, ANY)):
            stats = self._stats.get(key)
            if stats is not None and stats.weight >= self.config.min_samples:
                return self._fit(stats)
        return self.config.prior

    def p_resume_within(
        self, agent: str, stop_reason: str, t: float, elapsed: float = 0.0
    ) -> float:
        """Shortcut for ``distribution(agent, stop_reason).p_resume_within(t, elapsed)``."""
        return self.distribution(agent, stop_reason).p_resume_within(t, elapsed)

    def _fit(self, s: _Stats) -> GapDistribution:
        mu = s.sum_log / s.weight
        var = max(0.0, s.sum_log2 / s.weight - mu * mu)
        p_return = (s.returns + 1.0) / (s.returns + s.abandons + 2.0)
        return GapDistribution(mu, max(math.sqrt(var), self.config.min_sigma), p_return, s.weight)

    def _levels(self, agent: str, stop_reason: str) -> list[_Stats]:
        keys = {(agent, stop_reason), (agent, ANY), (ANY, stop_reason), (ANY, ANY)}
        out: list[_Stats] = []
        for key in sorted(keys):
            stats = self._stats.pop(key, None) or _Stats()
            self._stats[key] = stats  # re-insert: dict order = least recently updated first
            out.append(stats)
        while len(self._stats) > self.config.max_keys:
            oldest = next(iter(self._stats))
            if oldest == (ANY, ANY):
                self._stats[oldest] = self._stats.pop(oldest)
                continue
            del self._stats[oldest]
        return out
