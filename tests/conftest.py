"""Shared fixtures: a real Redis server for the session, a namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.helpers.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def namespace(redis_server: RedisServer) -> Iterator[str]:
    """A key namespace of this test's own; its keys are deleted afterwards."""
    ns = f"t{uuid.uuid4().hex[:10]}"
    yield ns
    client = redis.Redis.from_url(redis_server.url)
    keys = list(client.scan_iter(f"{ns}:*"))
    if keys:
        client.delete(*keys)
    client.close()
