"""The retention overhead budget: how much prefill kvkeeper's own requests may cost an engine.

Retention's real cost is the prompt tokens the engine recomputes for kvkeeper's requests: a
touch recomputes one token when its prefix is still cached, more when LRU took the prefix's
tail while the touch waited in the queue; a warm-up re-prefills what neither the engine nor an
offload tier kept. On a congested engine that prefill delays the clients' own requests.

The budget caps it at ``share`` of the prompt tokens the engine served to clients: a token
bucket that earns ``share`` credit per served prompt token, up to ``burst_tokens`` (so a quiet
period cannot bank an unbounded burst), and starts full. A touch or warm-up is admitted only
when the credit covers its expected cost; the estimate is reserved at admission (so touches
admitted in one tick cannot spend the same credit twice) and settled against what the engine
reported once the request ends. A touch that recomputed more than reserved leaves the credit
negative: nothing more is admitted until served traffic pays it back. Over any stretch of
traffic the recompute therefore stays within ``share`` x served + ``burst_tokens``, plus what
the requests in flight at its end overshoot their estimates, plus what was forgiven (below).

One accident must not silence retention for the rest of a run (a touch that raced LRU once
recomputed 44K tokens against a 4K bucket: 40K of debt at 1% of served tokens took longer to
repay than the run lasted). So the debt is capped at one bucket (``-burst_tokens``): what a
request recomputed beyond that is ``forgiven`` here, counted, and charged in full to the
retention guard (``policy.guard``), which judges retention by what it bought rather than by
one request. And a touch is priced at most one bucket: its kind's estimate learns from each
recompute clipped at the bucket's size, and admission reserves at most that. Unclipped, one
44K outlier put the estimate at 8.8K, past what a full bucket holds: no touch was admitted
again, so none could teach the estimate that touches cost one token.

A touch's cost is not known in advance (it depends on what LRU takes while it waits), so the
budget keeps a running estimate per kind of touch: an exponentially weighted mean of recent
touches' recompute. Kinds differ: a session's touch races LRU for the tail of a context that
has been idle, an agent anchor's touch re-sends whole blocks its agent's calls keep recent (one
token when resident), so one estimate for both would price anchors out at the sessions' cost.

Sessions the client protected (a TTL it asked for) take precedence over ``guessed`` ones
(protected by kvkeeper's guess, ``policy.returns``): a guessed session's touch is admitted only
when the credit left after it still covers ``reserve``, one touch at the running estimate for
every client-protected session the engine keeps (:meth:`OverheadBudget.guessed_reserve`). A
guess thus spends only credit the client's sessions leave; the reserve is capped so a full
bucket, which would earn nothing more, still admits one.

Pure: nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policy.smoothing import ewma

SESSION_TOUCH = "session"  # kinds of touch, each with its own running recompute estimate


@dataclass(frozen=True, slots=True)
class OverheadConfig:
    """``share``: recomputed retention tokens per served prompt token (None = unbounded);
    ``burst_tokens``: the most credit the bucket holds (and starts with);
    ``touch_alpha``: weight of the newest touch in the running touch-cost estimate."""

    share: float | None = 0.01
    burst_tokens: float = 4096.0
    touch_alpha: float = 0.2

    def __post_init__(self) -> None:
        if self.share is not None and not 0.0 < self.share <= 1.0:
            raise ValueError("share must be within (0, 1] (or None: unbounded)")
        if self.burst_tokens < 0:
            raise ValueError("burst_tokens must be >= 0")
        if not 0.0 < self.touch_alpha <= 1.0:
            raise ValueError("touch_alpha must be within (0, 1]")


class OverheadBudget:
    """One engine's retention budget (see the module docstring)."""

    __slots__ = (
        "_initial_estimate",
        "config",
        "credit",
        "declined",
        "estimates",
        "forgiven",
        "spent",
    )

    def __init__(self, config: OverheadConfig | None = None, touch_estimate: float = 1.0) -> None:
        self.config = config or OverheadConfig()
        self.credit = self.config.burst_tokens
        self._initial_estimate = max(1.0, touch_estimate)  # a resident prefix costs one token
        self.estimates: dict[str, float] = {}  # kind of touch -> running recompute estimate
        self.spent = 0.0  # recomputed tokens settled so far
        self.declined = 0  # admissions refused so far
        self.forgiven = 0.0  # recompute beyond the debt cap (the guard was charged with it)

    def estimate(self, kind: str = SESSION_TOUCH) -> float:
        """The running recompute estimate of one kind of touch."""
        return self.estimates.get(kind, self._initial_estimate)

    @property
    def touch_estimate(self) -> float:
        """The sessions' touch estimate."""
        return self.estimate()

    @property
    def bounded(self) -> bool:
        return self.config.share is not None

    def earn(self, served_prompt_tokens: int) -> None:
        """Credit for prompt tokens the engine served to a client."""
        if self.config.share is None or served_prompt_tokens <= 0:
            return
        self.credit = min(
            self.config.burst_tokens, self.credit + self.config.share * served_prompt_tokens
        )

    def admit(self, expected_tokens: float) -> bool:
        """Reserve ``expected_tokens`` of credit for a touch or warm-up; False (nothing
        reserved) when the credit does not cover it."""
        if self.config.share is None:
            return True
        cost = max(0.0, expected_tokens)
        if cost > self.credit or (cost == 0.0 and self.credit < 0.0):
            self.declined += 1
            return False
        self.credit -= cost
        return True

    def admit_touch(self, kind: str = SESSION_TOUCH, *, reserve: float = 0.0) -> float | None:
        """Admit a touch of ``kind`` at its running estimate, capped at the bucket's size (a
        full bucket always admits one), if at least ``reserve`` credit is left after it
        (module docstring); the amount reserved, or None if declined."""
        cost = min(math.ceil(self.estimate(kind)), max(1, math.floor(self.config.burst_tokens)))
        keep = min(max(0.0, reserve), self.config.burst_tokens - cost)
        if self.bounded and keep > 0 and self.credit - cost < keep:
            self.declined += 1
            return None
        return float(cost) if self.admit(cost) else None

    def guessed_reserve(self, client_sessions: int) -> float:
        """Credit a guessed session's touch must leave: one session touch at the running
        estimate for each of ``client_sessions`` client-protected sessions."""
        return max(0, client_sessions) * self.touch_estimate

    def settle(
        self, reserved: float, recomputed: float, *, touch: bool = False, kind: str = SESSION_TOUCH
    ) -> None:
        """A request admitted with ``reserved`` credit ended having recomputed ``recomputed``
        tokens (0 when abandoned before it ran); a touch also updates its kind's estimate."""
        actual = max(0.0, recomputed)
        self.spent += actual
        if touch:  # priced at most one bucket (module docstring)
            sample = min(actual, max(1.0, self.config.burst_tokens))
            old = self.estimate(kind)
            self.estimates[kind] = max(1.0, ewma(old, sample, self.config.touch_alpha))
        if self.config.share is None:
            return
        credit = min(self.config.burst_tokens, self.credit + reserved - actual)
        floor = -self.config.burst_tokens  # the most debt there may be (module docstring)
        if credit < floor:
            self.forgiven += floor - credit
            credit = floor
        self.credit = credit
