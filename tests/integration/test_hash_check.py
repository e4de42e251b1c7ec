"""The block-hash self-check against the simulator: same hash seed -> ok; a different seed (an
engine started without kvkeeper's PYTHONHASHSEED) -> an error log, kvkeeper_hash_check 0,
hash_check in /admin/engines, and feedback mode."""

from __future__ import annotations

import logging

import pytest

from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN_HEADERS
from tests.integration.retention_fixtures import SimStack, prompt, sim_stack, wait_for


async def _engine(st: SimStack) -> dict[str, object]:
    resp = await st.proxy.get("/admin/engines", headers=ADMIN_HEADERS)
    (engine,) = (await resp.json())["data"]
    return dict(engine)


async def _decided(st: SimStack) -> bool:
    check = (await _engine(st))["hash_check"]
    return isinstance(check, dict) and check["status"] != "pending"


async def test_matching_seed_passes(redis_server: RedisServer, namespace: str) -> None:
    async with sim_stack(redis_server.url, namespace, sim={"hash_seed": "0"}) as st:
        assert (await _engine(st))["hash_check"]["status"] == "pending"  # type: ignore[index]
        assert await st.metric("kvkeeper_hash_check") == -1.0
        await st.complete(prompt(1, 200))  # the engine stores (and publishes) its blocks
        assert await wait_for(lambda: _decided(st))
        engine = await _engine(st)
        assert engine["hash_check"]["status"] == "ok"  # type: ignore[index]
        assert engine["retention"]["mode"] == "events"  # type: ignore[index]
        assert await st.metric("kvkeeper_hash_check") == 1.0


async def test_other_seed_is_loud_and_falls_back_to_feedback(
    redis_server: RedisServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeeper.hashcheck")
    async with sim_stack(redis_server.url, namespace, sim={"hash_seed": "12345"}) as st:
        for seed in range(3):  # three prompts the engine stores from their first block
            await st.complete(prompt(seed, 200))
        assert await wait_for(lambda: _decided(st))
        engine = await _engine(st)
        check = engine["hash_check"]
        assert check["status"] == "mismatch"  # type: ignore[index]
        assert "PYTHONHASHSEED" in check["detail"]  # type: ignore[index]
        assert engine["retention"]["mode"] == "feedback"  # type: ignore[index]
        assert await st.metric("kvkeeper_hash_check") == 0.0
        assert st.runtime().retention.engines[engine["name"]].signals.subscription is None  # type: ignore[union-attr,index]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "hash check" in errors[0].getMessage()
    assert "feedback mode" in errors[0].getMessage()
