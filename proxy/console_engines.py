"""The console's engine view: per engine health, load, horizon, retention credit, touches and tier
pins, and the time series of hit rate and TTFT sampled into ring buffers."""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.console_models import (
    ConsoleEngine,
    ConsoleEngines,
    EngineLoadView,
    RetentionCredit,
    SeriesPoint,
)
from proxy.runtime import RUNTIME, Runtime

SAMPLE_EVERY_S = 2.0
SAMPLES = 180  # six minutes of series per engine


class _Samples:
    """The current samples of some metrics: this process's, or with worker processes
    (``PROMETHEUS_MULTIPROC_DIR``, ``serve --workers``) every worker's, as /metrics sums them."""

    def __init__(self, metrics: Iterable[Any]) -> None:
        wanted = list(metrics)
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder:
            names = {f.name for m in wanted for f in m.describe()}
            merged = MultiProcessCollector(CollectorRegistry(), path=folder)  # type: ignore[no-untyped-call]
            collected = merged.collect()  # type: ignore[no-untyped-call]
            families = [f for f in collected if f.name in names]
        else:
            families = [f for m in wanted for f in m.collect()]
        self.samples = [
            s for f in families for s in f.samples if not s.name.endswith("_created")
        ]  # _created: a timestamp, not a count

    def by(self, name: str, engine: str, key: str = "engine") -> dict[str, float]:
        """``{value of label key: sum}`` of sample ``name``'s series on ``engine``."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name and s.labels.get("engine") == engine:
                k = s.labels.get(key, "")
                out[k] = out.get(k, 0.0) + s.value
        return out

    def total(self, name: str, engine: str) -> float:
        return sum(self.by(name, engine).values())


@dataclass
class _Last:
    requests: float = 0.0
    prompt: float = 0.0
    cached: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0


@dataclass
class Series:
    """Per engine ring buffers of :class:`SeriesPoint`, fed by :meth:`sample`."""

    points: dict[str, deque[SeriesPoint]] = field(default_factory=dict)
    last: dict[str, _Last] = field(default_factory=dict)

    def sample(self, rt: Runtime, now: float) -> None:
        m = rt.metrics
        got = _Samples(
            (m.engine_requests, m.engine_prompt_tokens, m.engine_cached_tokens, m.engine_ttft)
        )
        for engine in rt.pool.engines:
            name = engine.name
            cur = _Last(
                got.total("kvkeeper_engine_requests_total", name),
                got.total("kvkeeper_engine_prompt_tokens_total", name),
                got.total("kvkeeper_engine_cached_tokens_total", name),
                got.total("kvkeeper_engine_ttft_seconds_sum", name),
                got.total("kvkeeper_engine_ttft_seconds_count", name),
            )
            prev = self.last.get(name)
            self.last[name] = cur
            if prev is None:
                prev = cur
            prompt = cur.prompt - prev.prompt
            count = cur.ttft_count - prev.ttft_count
            load = engine.signals.load
            horizon = engine.signals.horizon_s
            point = SeriesPoint(
                t=round(now, 3),
                requests=int(cur.requests - prev.requests),
                hit_rate=round((cur.cached - prev.cached) / prompt, 4) if prompt > 0 else None,
                ttft_s=round((cur.ttft_sum - prev.ttft_sum) / count, 5) if count > 0 else None,
                kv_cache_usage=load.kv_cache_usage if load is not None else None,
                inflight=engine.inflight,
                horizon_s=None if math.isinf(horizon) else round(horizon, 3),
            )
            self.points.setdefault(name, deque(maxlen=SAMPLES)).append(point)


CONSOLE_SERIES = web.AppKey("console_series", Series)


def _engine(rt: Runtime, name: str, series: list[SeriesPoint], got: _Samples) -> ConsoleEngine:
    e = rt.pool.by_name[name]
    view = rt.retention.engine_view(name) if rt.retention is not None else None
    load = e.signals.load
    over = view.overhead if view is not None else None
    served = [p for p in series if p.hit_rate is not None]
    return ConsoleEngine(
        name=name,
        url=e.url,
        healthy=e.healthy,
        inflight=e.inflight,
        last_error=e.last_error,
        retention=view is not None,
        mode=view.mode if view is not None else None,
        leader=view.leader if view is not None else None,
        horizon_s=view.horizon_s if view is not None else None,
        horizon_source=view.horizon_source if view is not None else None,
        load=(
            EngineLoadView(
                pool_blocks=load.pool_blocks,
                kv_cache_usage=load.kv_cache_usage,
                waiting=load.waiting,
                running=load.running,
            )
            if load is not None
            else None
        ),
        resident_blocks=view.resident_blocks if view is not None else {},
        protected_sessions=int(got.total("kvkeeper_protected_sessions", name)),
        credit=(
            RetentionCredit(
                max_share=over.max_share,
                credit_tokens=over.credit_tokens,
                recomputed_tokens=over.recomputed_tokens,
                declined=over.declined,
            )
            if over is not None
            else None
        ),
        touches={k: int(v) for k, v in got.by("kvkeeper_touches_total", name, "outcome").items()},
        tier=view.tier_pinned if view is not None else None,
        hit_rate=(
            round(sum(p.hit_rate or 0.0 for p in served) / len(served), 4) if served else None
        ),
        series=series,
    )


async def engines(request: web.Request) -> web.Response:
    """``GET /admin/console/engines`` (any admin principal)."""
    rt = request.app[RUNTIME]
    rt.tenants.principal(request.headers, rt.settings.admin_token)  # any admin principal
    points = request.app[CONSOLE_SERIES].points
    m = rt.metrics
    got = _Samples((m.protected_sessions, m.touches))
    body = ConsoleEngines(
        now=time.time(),
        sample_every_s=SAMPLE_EVERY_S,
        engines=[_engine(rt, e.name, list(points.get(e.name, ())), got) for e in rt.pool.engines],
    )
    return web.json_response(text=body.model_dump_json())
