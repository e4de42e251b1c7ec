"""Admission order on engines run with ``--scheduling-policy priority``.

vLLM admits waiting requests in order, and a waiting request holds no blocks: while a long
prefill ahead of it runs, the allocations evict the very prefix it would have hit. Under the
priority policy vLLM serves the waiting queue by ``(priority, arrival)`` (lower first), so
kvkeeper can order it from outside, per request, with a priority header (the engine adapter names it).

The priority is a virtual deadline: the time the request was sent, in milliseconds, plus a
slack proportional to the tokens the engine would have to compute for it (its prompt minus
the prefix kvkeeper knows is resident there). A request whose context is resident goes ahead
of one that must be re-prefilled, before LRU takes its context, and short prefills are not
stuck behind long ones; but a request never waits behind one sent more than its own slack
later, so nothing starves. Retention's touches get no slack: their prefixes are resident by
construction and a touch that waits is a touch that came too late.
"""

from __future__ import annotations

PRIORITY_EPOCH_S = 1_767_225_600  # 2026-01-01T00:00:00Z: keeps the integers short


def admission_slack_ms(uncached_tokens: float, slack_ms_per_ktok: float) -> float:
    """How long after its send time a request that needs ``uncached_tokens`` computed is due."""
    return slack_ms_per_ktok * max(0.0, uncached_tokens) / 1000.0


def admission_priority(now_s: float, slack_ms: float) -> int:
    """The virtual deadline (ms since :data:`PRIORITY_EPOCH_S`) of a request sent at ``now_s``
    (Unix seconds, so that several kvkeeper replicas in front of one engine agree)."""
    return int((now_s - PRIORITY_EPOCH_S) * 1000.0 + slack_ms)
