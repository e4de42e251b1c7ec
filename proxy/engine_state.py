"""``EngineState``: one engine as the retention layer drives it."""

from __future__ import annotations

from dataclasses import dataclass, field

from adapters.base import EngineAdapter
from adapters.lmcache import LMCacheAdapter
from policy.smoothing import Ewma
from proxy.keys import SessionKey
from proxy.signals import EngineSignals
from proxy.upstream import Engine


@dataclass(eq=False)
class EngineState:
    """One engine as the retention layer drives it: what it observes (``signals``) and the
    worker's own bookkeeping (lease, touches in flight, lapsed and lost sessions)."""

    engine: Engine
    tier: LMCacheAdapter | None = None
    leader_token: int = 0
    in_flight: set[SessionKey] = field(default_factory=set)
    overridden: set[SessionKey] = field(default_factory=set)
    # protected, but nothing resident: the session's last_used when that was found
    lost: dict[SessionKey, float] = field(default_factory=dict)
    no_tokenize: bool = False  # the engine serves no tokenizer: block ids stay unknown
    touch_latency: Ewma = field(default_factory=lambda: Ewma(0.2, 0.05))
    trimmed_blocks: int = 0  # blocks touches stopped short of (the front would take them first)

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def signals(self) -> EngineSignals:
        return self.engine.signals

    @property
    def adapter(self) -> EngineAdapter:
        return self.engine.adapter
