"""The way to the engines: one shared aiohttp client, engine health, and first-byte failover.

``open_upstream`` tries engines in the order routing chose; an engine that refuses the
connection (or drops it before answering) is marked down and the next one is tried. Once an
engine has answered with a status line, the request is committed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict

from adapters.base import EngineAdapter
from proxy.errors import UpstreamError
from proxy.metrics import Metrics
from proxy.settings import EngineSpec, UpstreamSettings
from proxy.signals import EngineSignals

log = logging.getLogger("kvkeeper.upstream")

# kvkeeper's own request headers: consumed here, never sent to the engine.
HINT_HEADERS = frozenset(
    h.lower() for h in ("X-Session-Id", "X-Parent-Session-Id", "X-Agent-Name", "X-Cache-TTL")
)
MAX_CONNECTIONS = 1024  # towards all engines together
MAX_CONNECTIONS_PER_ENGINE = 512
_CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)


@dataclass(eq=False)
class Engine:
    """One engine replica and what the proxy knows about it right now."""

    spec: EngineSpec
    adapter: EngineAdapter
    healthy: bool = True
    ready: bool = True  # the last health check's verdict (healthy also follows requests)
    inflight: int = 0
    last_error: str | None = None
    last_check: float = 0.0
    models: list[str] = field(default_factory=list)
    name: str = field(init=False)  # the spec's label, read on every request: computed once
    signals: EngineSignals = field(init=False)  # its load, residency and horizon

    def __post_init__(self) -> None:
        self.name = self.spec.label
        self.signals = EngineSignals(self.name, self.adapter)

    @property
    def url(self) -> str:
        return self.spec.url


def make_client(cfg: UpstreamSettings) -> aiohttp.ClientSession:
    """The one client session towards all engines, with explicit limits and timeouts."""
    connector = aiohttp.TCPConnector(
        limit=MAX_CONNECTIONS,
        limit_per_host=MAX_CONNECTIONS_PER_ENGINE,
        ttl_dns_cache=300,
        keepalive_timeout=30,
    )
    timeout = aiohttp.ClientTimeout(
        total=None, connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
    )
    # auto_decompress=False: bytes reach the client exactly as the engine sent them
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False, raise_for_status=False
    )


def upstream_headers(
    headers: Mapping[str, str],
    request_id: str,
    *,
    hop_by_hop: frozenset[str],
    api_key: str | None,
    drop_auth: bool,
) -> CIMultiDict[str]:
    """Request headers for the engine: hop-by-hop and hint headers removed, id propagated."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low in hop_by_hop or low in HINT_HEADERS:
            continue
        if low == "authorization" and (drop_auth or api_key):
            continue
        out.add(name, value)
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    out["X-Request-Id"] = request_id
    return out


def response_headers(headers: Mapping[str, str], hop_by_hop: frozenset[str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in hop_by_hop:
            out.add(name, value)
    return out


class EnginePool:
    """The configured engines, their health, and the forwarding client."""

    def __init__(
        self, engines: Sequence[Engine], client: aiohttp.ClientSession, metrics: Metrics
    ) -> None:
        self.engines = list(engines)
        self.by_name = {e.name: e for e in self.engines}
        self.client = client
        self.metrics = metrics
        self._recheck: asyncio.Future[list[bool]] | None = None

    def get(self, name: str | None) -> Engine | None:
        return self.by_name.get(name) if name else None

    def mark(self, engine: Engine, healthy: bool, error: str | None = None) -> None:
        if engine.healthy != healthy:
            log.warning(
                "engine %s is now %s%s",
                engine.name,
                "up" if healthy else "down",
                f" ({error})" if error else "",
            )
        engine.healthy = healthy
        engine.last_error = error
        self.metrics.engine_up.labels(engine.name).set(1 if healthy else 0)

    async def open(
        self,
        order: Sequence[Engine],
        method: str,
        path: str,
        headers: CIMultiDict[str],
        body: bytes,
    ) -> tuple[Engine, aiohttp.ClientResponse]:
        """Send the request to the first engine that accepts it (first-byte failover).

        The chosen engine's ``inflight`` count includes this request; the caller decrements it.
        """
        last: str = "no engine is ready"
        for attempt, engine in enumerate(order):
            engine.inflight += 1  # the caller decrements once the response is relayed
            try:
                resp = await self.client.request(
                    method, engine.url + path, data=body, headers=headers, allow_redirects=False
                )
            except BaseException as exc:
                engine.inflight -= 1
                if not isinstance(exc, _CONNECT_ERRORS):
                    if isinstance(exc, TimeoutError):
                        self.metrics.upstream_errors.labels(engine.name, "timeout").inc()
                        raise UpstreamError(f"engine {engine.name} timed out", status=504) from None
                    raise
                last = f"{engine.name}: {type(exc).__name__}: {exc}"
                self.metrics.upstream_errors.labels(engine.name, "connect").inc()
                self.mark(engine, False, str(exc))
                continue
            if attempt:
                self.metrics.failovers.inc()
            if not engine.healthy:
                self.mark(engine, True)
            return engine, resp
        raise UpstreamError(
            f"no engine could take the request ({last})",
            status=502 if order else 503,
            code="engine_unavailable",
        )

    async def check(self, engine: Engine) -> bool:
        """Active health check: the adapter's health routes in order (404: the next one)."""
        for route in engine.adapter.health_routes:
            try:
                async with self.client.get(
                    engine.url + route, timeout=aiohttp.ClientTimeout(total=3)
                ) as resp:
                    await resp.read()
                    if resp.status == 200:
                        engine.ready = True
                        self.mark(engine, True)
                        engine.last_check = time.time()
                        return True
                    if resp.status != 404:
                        break
            except (TimeoutError, aiohttp.ClientError) as exc:
                engine.ready = False
                self.mark(engine, False, f"{type(exc).__name__}: {exc}")
                engine.last_check = time.time()
                return False
        engine.ready = False
        self.mark(engine, False, "health check failed")
        engine.last_check = time.time()
        return False

    async def recheck(self) -> None:
        """Health-check the engines not ready now, at once (when none is ready, a request asks
        rather than wait for the loop); one check at a time, shared by every caller."""
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.gather(*(self.check(e) for e in self.engines if not e.ready))
        await asyncio.shield(self._recheck)

    async def health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.gather(*(self.check(e) for e in self.engines))
            await asyncio.sleep(interval_s)

    async def models(self) -> list[dict[str, object]]:
        """``/v1/models`` merged across healthy engines (first engine's entry wins per id)."""

        async def one(engine: Engine) -> list[dict[str, object]]:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with self.client.get(
                    engine.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    if resp.status == 200:
                        data = (await resp.json(content_type=None)).get("data", [])
                        engine.models = [str(m.get("id")) for m in data if isinstance(m, dict)]
                        return [m for m in data if isinstance(m, dict)]
            return []

        merged: dict[str, dict[str, object]] = {}
        for batch in await asyncio.gather(*(one(e) for e in self.engines if e.healthy)):
            for model in batch:
                merged.setdefault(str(model.get("id")), model)
        return list(merged.values())
