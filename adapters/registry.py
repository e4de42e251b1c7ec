"""Engine adapters by kind: ``EngineSpec.kind`` names one, ``create_adapter`` builds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from adapters.base import CacheConfig, EngineAdapter
from adapters.vllm import EventEndpoints, VLLMAdapter


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What an adapter is built from (the engine's settings, engine-neutral)."""

    name: str
    url: str
    events: str | None = None  # KV-event endpoint when configured
    cache: CacheConfig = field(default_factory=CacheConfig)
    touch_priority: Callable[[], int] | None = None  # the priority touches carry, if any


AdapterFactory = Callable[[AdapterSpec, aiohttp.ClientSession], EngineAdapter]


def _vllm(spec: AdapterSpec, session: aiohttp.ClientSession) -> EngineAdapter:
    return VLLMAdapter(
        spec.name,
        spec.url,
        session,
        cache=spec.cache,
        events=EventEndpoints(endpoint=spec.events) if spec.events else None,
        touch_priority=spec.touch_priority,
    )


_FACTORIES: dict[str, AdapterFactory] = {"vllm": _vllm}


def register(kind: str, factory: AdapterFactory) -> None:
    """Make ``kind`` available to ``EngineSpec.kind`` (tests register an in-memory engine)."""
    _FACTORIES[kind] = factory


def kinds() -> frozenset[str]:
    return frozenset(_FACTORIES)


def create_adapter(kind: str, spec: AdapterSpec, session: aiohttp.ClientSession) -> EngineAdapter:
    try:
        factory = _FACTORIES[kind]
    except KeyError:
        raise ValueError(
            f"unknown engine kind {kind!r}; known: {', '.join(sorted(_FACTORIES))}"
        ) from None
    return factory(spec, session)
