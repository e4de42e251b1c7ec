"""Building blocks for proxy integration tests: fake engines + a real Redis + the real app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from proxy.app import create_app, server_options
from proxy.settings import Settings, load_settings
from tests.helpers.fake_engine import FakeEngine, serve_fake

ADMIN = "admin-secret"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@dataclass
class Stack:
    client: TestClient[Any, Any]
    engines: list[FakeEngine]
    settings: Settings

    @property
    def engine(self) -> FakeEngine:
        return self.engines[0]


@asynccontextmanager
async def proxy_stack(
    redis_url: str,
    namespace: str,
    *,
    n_engines: int = 1,
    extra_engine_urls: list[str] | None = None,
    tenants_file: Path | None = None,
    engine_factory: Callable[[int], FakeEngine] | None = None,
    overrides: dict[str, Any] | None = None,
    **limits: Any,
) -> AsyncIterator[Stack]:
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                serve_fake((engine_factory or (lambda i: FakeEngine(name=f"e{i}")))(i))
            )
            for i in range(n_engines)
        ]
        urls = [*(extra_engine_urls or []), *(e.url for e in engines)]
        settings = load_settings(
            engines=[{"url": u} for u in urls],
            redis_url=redis_url,
            namespace=namespace,
            admin_token=ADMIN,
            tenants_file=tenants_file,
            limits=limits or None,
            health_interval_s=60,
            **(overrides or {}),
        )
        server = TestServer(create_app(settings))
        await server.start_server(**server_options(settings))  # the options `serve` runs with
        client: TestClient[Any, Any] = TestClient(server)
        await client.start_server()
        stack.push_async_callback(client.close)
        yield Stack(client, engines, settings)
