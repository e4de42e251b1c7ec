"""Retention on the simulator: protection survives floods, expiry, budget, leases, edits."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp
import pytest

import proxy.app
import proxy.block_cache
import proxy.forward
import proxy.retention
import proxy.touches
from adapters.base import AdapterError
from policy.guard import GuardConfig
from policy.overhead import OverheadBudget, OverheadConfig
from proxy.block_cache import PRUNE_EVERY_S
from proxy.keys import SessionKey
from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import (
    BLOCK,
    SimStack,
    cached,
    prompt,
    sim_stack,
    wait_for,
)

FULL = 2016  # 2,017-token prompts: 63 full blocks, all of them cacheable on a repeat


async def _flood(st, n: int = 8, base: int = 100) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for i in range(n):
        total += (await st.complete(prompt(base + i)))["usage"]["prompt_tokens"]
    return total


def _engine_state(st):  # type: ignore[no-untyped-def]
    """The retention layer of the stack's proxy and its (only) engine's state."""
    retention = st.runtime().retention
    assert retention is not None
    return retention, next(iter(retention.engines.values()))


async def _protected(st, sid: str):  # type: ignore[no-untyped-def]
    """A protected session of one 2,017-token prompt: retention, engine state, session, blocks."""
    await st.complete(
        prompt(1), {"session_id": sid, "cache_control": {"type": "ephemeral", "ttl": 300}}
    )
    retention, es = _engine_state(st)
    await st.runtime().settle()
    session = await retention.store.get("default", sid)
    assert session is not None
    return (
        retention,
        es,
        session,
        await retention.blocks.blocks_of(SessionKey("default", sid), session),
    )


async def _known_blocks(st, sid: str, i: int = 0, n: int = 63) -> None:  # type: ignore[no-untyped-def]
    retention = st.runtime(i).retention

    async def known() -> bool:
        return len(await retention.blocks.blocks_of(SessionKey("default", sid))) == n

    assert await wait_for(known), "retention never learned the session's blocks"


async def test_protected_survives_a_flood_that_evicts_the_unprotected(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace) as st:
        await st.complete(
            prompt(1), {"session_id": "kept", "cache_control": {"type": "ephemeral", "ttl": 300}}
        )
        await st.complete(prompt(2), {"session_id": "plain"})
        await _known_blocks(st, "kept")
        flood_tokens = await _flood(st)  # 8 x 63 blocks through a 200-block pool
        kept = cached(await st.complete(prompt(1), {"session_id": "kept"}))
        plain = cached(await st.complete(prompt(2), {"session_id": "plain"}))
        assert kept >= 0.95 * FULL, kept
        assert plain == 0
        touches = await st.metric("kvkeeper_touches_total")
        recomputed = await st.metric("kvkeeper_touch_recomputed_tokens_total")
        assert touches >= 1
        assert recomputed < 0.02 * flood_tokens, (recomputed, flood_tokens)
        admin = {"Authorization": "Bearer admin-secret"}
        s = await (await st.proxy.get("/admin/sessions/kept", headers=admin)).json()
        assert s["counters"]["touches"] >= 1 and s["residency"]["blocks"] == 63
        engines = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        view = engines["data"][0]["retention"]
        assert view["mode"] == "events" and view["leader"] is True and view["horizon_s"] is not None


async def test_without_events_feedback_mode_is_reported(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace, events=False) as st:
        await st.complete(prompt(1), {"session_id": "s", "cache_control": {"ttl": 60}})
        admin = {"Authorization": "Bearer admin-secret"}
        engines = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        # the simulator serves /kv_event_sources, so even unconfigured, events are discovered
        assert engines["data"][0]["retention"]["mode"] in ("events", "feedback")


async def test_expiry_ends_protection(redis_server: RedisServer, namespace: str) -> None:
    async with sim_stack(redis_server.url, namespace) as st:
        await st.complete(prompt(1), {"session_id": "short", "cache_control": {"ttl": 0.5}})
        admin = {"Authorization": "Bearer admin-secret"}

        async def idle() -> bool:
            s = await (await st.proxy.get("/admin/sessions/short", headers=admin)).json()
            return bool(s["state"] == "idle")

        assert await wait_for(idle, within=5)
        assert await st.metric("kvkeeper_expiries_total") == 1
        touches_before = await st.metric("kvkeeper_touches_total")
        await _flood(st)
        assert cached(await st.complete(prompt(1), {"session_id": "short"})) == 0
        assert await st.metric("kvkeeper_touches_total") == touches_before


async def test_budget_caps_protection(redis_server: RedisServer, namespace: str) -> None:
    # 200 blocks x 0.5 = 100 protected blocks at most: two 63-block sessions cannot both be kept
    async with sim_stack(redis_server.url, namespace, budget_share=0.5) as st:
        for sid, seed in (("a", 1), ("b", 2)):
            await st.complete(prompt(seed), {"session_id": sid, "cache_control": {"ttl": 300}})
            await _known_blocks(st, sid)

        async def overridden() -> bool:
            return await st.metric("kvkeeper_pressure_overrides_total") >= 1

        assert await wait_for(overridden, within=8)
        await _flood(st)
        hits = sorted([cached(await st.complete(prompt(1))), cached(await st.complete(prompt(2)))])
        assert hits[1] >= 0.95 * FULL  # the one inside the budget survived
        assert hits[0] == 0  # the lapsed one was evicted, and traffic got its blocks


async def test_two_replicas_never_both_drive_and_hand_over(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proxy.retention, "LEASE_TTL_S", 1.0)  # a quicker hand-over
    async with sim_stack(redis_server.url, namespace, replicas=2) as st:

        def token(i: int) -> int:
            return next(iter(st.runtime(i).retention.engines.values())).leader_token

        async def one_leader() -> bool:
            return sum(1 for i in (0, 1) if token(i)) == 1

        await st.complete(prompt(1), {"session_id": "kept", "cache_control": {"ttl": 300}})
        assert await wait_for(one_leader)
        await _known_blocks(st, "kept", 0)
        await _flood(st, n=6)
        touches = [await st.metric("kvkeeper_touches_total", i) for i in (0, 1)]
        assert (touches[0] > 0) != (touches[1] > 0), touches  # exactly one replica touched
        leader = 0 if touches[0] > 0 else 1
        other = 1 - leader
        fence = token(leader)
        await st.proxies[leader].close()  # the holder goes away: the other takes over

        async def took_over() -> bool:
            return token(other) > fence  # a new, larger fencing token

        start = asyncio.get_running_loop().time()
        assert await wait_for(took_over, within=5)
        assert asyncio.get_running_loop().time() - start < 3.0
        survivor = SimStack(st.sim, [st.proxies[other]])
        await _flood(survivor, n=6, base=300)
        assert await survivor.metric("kvkeeper_touches_total") > 0
        assert cached(await survivor.complete(prompt(1))) >= 0.95 * FULL


async def test_offload_prefetch_evict_through_the_cpu_tier(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace, cpu_blocks=1000) as st:
        await st.complete(prompt(1), {"session_id": "w", "cache_control": {"ttl": 300}})
        await _known_blocks(st, "w")
        result = await st.manage("w", "offload")
        off = result["results"][0]
        assert off["status"] == "applied", off
        assert off["detail"]["stored_tokens"] == 1792  # 7 full 256-token chunks of 2,017 tokens
        admin = {"Authorization": "Bearer admin-secret"}
        s = await (await st.proxy.get("/admin/sessions/w", headers=admin)).json()
        assert s["state"] == "offloaded" and s["ttl_left_s"] == 0
        await _flood(st)  # the GPU copy is gone now (no protection after offload)
        pre = (await st.manage("w", "prefetch"))["results"][0]
        assert pre["status"] == "applied"
        assert pre["detail"]["cached_tokens"] >= 1792  # loaded from the CPU tier, not recomputed
        assert cached(await st.complete(prompt(1), {"session_id": "w"})) >= 0.95 * FULL
        ev = (await st.manage("w", "evict"))["results"][0]
        assert ev["status"] == "applied" and ev["detail"]["tier_chunks_deleted"] == 7
        tier = next(iter(st.runtime().retention.engines.values())).tier
        assert tier is not None and await tier.lookup(prompt(1)) == 0


async def test_evict_keeps_the_chunks_an_unrelated_session_starts_with(
    redis_server: RedisServer, namespace: str
) -> None:
    """Two users' sessions start with one agent's 768-token system prompt: evicting one when it
    finishes must not delete that prompt's chunks from the tier under the other."""
    system = prompt(50, 768)
    a, b = system + prompt(1, 1249), system + prompt(2, 1249)
    async with sim_stack(redis_server.url, namespace, cpu_blocks=1000) as st:
        await st.complete(a, {"session_id": "a", "cache_control": {"ttl": 300}})
        await st.complete(b, {"session_id": "b", "cache_control": {"ttl": 300}})
        await _known_blocks(st, "a")
        await _known_blocks(st, "b")
        ev = (await st.manage("a", "evict"))["results"][0]
        assert ev["status"] == "applied", ev
        assert ev["detail"]["tier_chunks_deleted"] == 0
        assert ev["detail"]["shared_tokens_kept"] == 768
        tier = st.sim.engine.cpu
        assert tier is not None and tier.lookup_prefix(b, None) == 7 * 256


@pytest.mark.parametrize(("burst", "status"), [(64, "rejected"), (4096, "applied")])
async def test_an_offload_that_must_re_prefill_spends_retention_credit(
    redis_server: RedisServer,
    namespace: str,
    burst: int,
    status: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Neither the GPU nor the (small) tier kept the session: storing it means re-prefilling
    its 63 blocks, which the retention credit must cover like a warm-up's."""
    monkeypatch.setattr(proxy.retention, "OVERHEAD_BURST_TOKENS", burst)
    async with sim_stack(
        redis_server.url, namespace, cpu_blocks=100, max_overhead_share=1e-6
    ) as st:
        await st.complete(prompt(1), {"session_id": "w"})
        await _known_blocks(st, "w")
        await _flood(st)  # gone from the GPU, and from a tier of 100 blocks
        _, es = _engine_state(st)

        async def lost() -> bool:
            blocks = await st.runtime().retention.blocks.blocks_of(SessionKey("default", "w"))
            return es.signals.index.resident_prefix(blocks) == 0

        assert await wait_for(lost), "the flood never evicted the session"
        off = (await st.manage("w", "offload"))["results"][0]
        assert off["status"] == status, off
        if status == "rejected":
            assert off["reason"] == "exceeds_overhead_budget"
            assert off["detail"]["recompute_tokens"] == 63 * BLOCK + 1
            assert await st.metric("kvkeeper_warmup_prompt_tokens_total") == 0  # none sent
        else:
            assert off["detail"]["touched"] is True
            assert es.signals.overhead.spent >= 1792  # the re-prefill was paid from the credit


async def test_offload_without_a_tier_is_unsupported(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace) as st:
        await st.complete(prompt(1), {"session_id": "w", "cache_control": {"ttl": 300}})
        result = (await st.manage("w", "offload"))["results"][0]
        assert result == {"type": "offload", "status": "unsupported", "reason": "no_offload_tier"}
        admin = {"Authorization": "Bearer admin-secret"}
        s = await (await st.proxy.get("/admin/sessions/w", headers=admin)).json()
        assert s["state"] == "protected"  # nothing changed


async def test_admin_operations(redis_server: RedisServer, namespace: str) -> None:
    async with sim_stack(redis_server.url, namespace) as st:
        await st.complete(prompt(1), {"session_id": "w"})
        await _known_blocks(st, "w")
        admin = {"Authorization": "Bearer admin-secret"}
        r = await st.proxy.post("/admin/sessions/w/pin", headers=admin, json={"ttl": 120})
        assert r.status == 200 and (await r.json())["status"] == "applied"
        s = await (await st.proxy.get("/admin/sessions/w", headers=admin)).json()
        assert s["state"] == "protected" and 100 < s["ttl_left_s"] <= 120
        r = await st.proxy.post(
            "/admin/sessions/w/prefetch", headers=admin, json={"block_start": 0, "block_end": 10}
        )
        body = await r.json()
        # blocks 0-9 and one token more, so that all ten are looked up (and hit if resident)
        assert body["status"] == "applied" and body["detail"]["prompt_tokens"] == 10 * BLOCK + 1
        r = await st.proxy.post(
            "/admin/sessions/w/evict", headers=admin, json={"block_start": 0, "block_end": 64}
        )
        assert (await r.json())["reason"] == "range_out_of_bounds"
        assert (
            await st.proxy.post("/admin/sessions/w/evict", headers=admin, json={"block_start": 3})
        ).status == 400
        assert (await st.proxy.post("/admin/sessions/w/explode", headers=admin)).status == 404
        assert (await st.proxy.post("/admin/sessions/nope/evict", headers=admin)).status == 404
        r = await st.proxy.post("/admin/sessions/w/evict", headers=admin)
        assert (await r.json())["status"] == "applied"
        s = await (await st.proxy.get("/admin/sessions/w", headers=admin)).json()
        assert s["state"] == "idle" and s["engine"] is None


async def test_a_touch_resends_only_the_resident_prefix(
    redis_server: RedisServer, namespace: str
) -> None:
    # ticks far apart: this test drives the touches itself
    async with sim_stack(redis_server.url, namespace, tick_s=3600) as st:
        retention, es, session, blocks = await _protected(st, "part")
        assert len(blocks) == 63 and es.signals.resident(blocks) == 63  # all resident
        await retention.touches.touch_session(es, session, 10)  # only the first 10 blocks
        # one token past the 10 blocks: all 10 hit (vLLM looks up at most prompt - 1 tokens)
        assert await st.metric("kvkeeper_touch_prompt_tokens_total") == 10 * BLOCK + 1
        assert await st.metric("kvkeeper_touch_recomputed_tokens_total") == 1
        await retention.touches.touch_session(
            es, session
        )  # all 63 resident: 63 blocks and one token
        assert await st.metric("kvkeeper_touch_prompt_tokens_total") == 73 * BLOCK + 2
        assert await st.metric("kvkeeper_touch_recomputed_tokens_total") == 2
        await _flood(st)  # 8 x 63 blocks through a 200-block pool: nothing of it is left

        async def gone() -> bool:
            return es.signals.resident(blocks) == 0

        assert await wait_for(gone), "the flood never evicted the session"
        # a touch finds that from the recorded context itself: nothing is sent, and the loss
        # is counted once until the session records something new
        sent = await st.metric("kvkeeper_touch_prompt_tokens_total")
        for _ in range(2):
            await retention.touches.touch_session(es, session)
        assert await st.metric("kvkeeper_touch_prompt_tokens_total") == sent
        assert await st.metric("kvkeeper_touches_total", label='outcome="skipped_lost"') == 1


async def test_a_touch_stops_short_of_the_blocks_lru_takes_before_it_runs(
    redis_server: RedisServer, namespace: str
) -> None:
    """A prefix LRU has begun to evict has the allocation front inside it: a touch re-sends
    only the resident blocks the front will not reach before the touch is served (allocation
    rate x touch latency), so it recomputes one token, not the blocks taken meanwhile."""
    async with sim_stack(redis_server.url, namespace, tick_s=3600) as st:
        retention, es, session, blocks = await _protected(st, "part")
        await _flood(st, n=3)  # 189 blocks through a 200-block pool: the session's tail goes

        async def partly() -> bool:
            return 0 < (es.signals.resident(blocks) or 0) < 63

        assert await wait_for(partly), es.signals.resident(blocks)
        resident = es.signals.resident(blocks)
        assert resident is not None
        es.touch_latency.value = 0.0  # served at once: every resident block is safe
        await retention.touches.touch_session(es, session)
        assert await st.metric("kvkeeper_touch_prompt_tokens_total") == resident * BLOCK + 1
        assert await st.metric("kvkeeper_touch_recomputed_tokens_total") == 1
        assert es.trimmed_blocks == 0
        # served in a minute at the flood's allocation rate: the front takes all of it first
        es.touch_latency.value = 60.0
        sent = await st.metric("kvkeeper_touch_prompt_tokens_total")
        await retention.touches.touch_session(es, session)
        assert await st.metric("kvkeeper_touch_prompt_tokens_total") == sent  # nothing sent
        assert await st.metric("kvkeeper_touches_total", label='outcome="skipped_lost"') == 1
        assert es.trimmed_blocks == resident


async def _warm_after_cold(st: SimStack) -> list[str]:
    """A warm session (its context resident) sent after three cold ones: one takes the engine,
    two queue, then the warm one arrives. The order the four finished in."""
    warm = {"session_id": "warm", "cache_control": {"type": "ephemeral", "ttl": 300}}
    await st.complete(prompt(1), warm)
    await _known_blocks(st, "warm")
    done: list[str] = []

    async def stream(name: str, tokens: list[int], hint: dict[str, object]) -> None:
        body = {"model": "sim", "prompt": tokens, "max_tokens": 1, "stream": True}
        resp = await st.proxy.post("/v1/completions", json={**body, "agent_hint": hint})
        assert resp.status == 200
        await resp.read()
        done.append(name)

    first = asyncio.create_task(stream("cold0", prompt(50), {"session_id": "c0"}))
    await asyncio.sleep(0.05)
    rest = [
        asyncio.create_task(stream(f"cold{i}", prompt(50 + i), {"session_id": f"c{i}"}))
        for i in (1, 2)
    ]
    await asyncio.sleep(0.05)
    rest.append(asyncio.create_task(stream("warm", prompt(1) + [5] * 40, warm)))
    await asyncio.gather(first, *rest)
    return done


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_admission_priority_lets_a_resident_prefix_pass_the_engines_queue(
    redis_server: RedisServer, namespace: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine runs one sequence at a time; kvkeeper holds nothing back. Under the priority
    policy the warm session, sent last, runs right after the request that holds the engine;
    first come, first served (the engine ignores priorities) it runs last."""
    sim = {"scheduling_policy": policy, "max_num_seqs": 1}
    monkeypatch.setattr(proxy.forward, "SLACK_MS_PER_KTOK", 10_000.0)
    async with sim_stack(
        redis_server.url,
        namespace,
        num_blocks=400,
        speed=5,
        sim=sim,
        admission_priority=True,
    ) as st:
        done = await _warm_after_cold(st)
        assert await st.metric("kvkeeper_admission_slack_seconds_count") == 5  # every request
        expected = ["cold0", "warm", "cold1", "cold2"]
        assert done == (expected if policy == "priority" else ["cold0", "cold1", "cold2", "warm"])


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_admission_priority_is_detected_from_the_engines_scheduling_policy(
    redis_server: RedisServer, namespace: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not configured, kvkeeper reads the engine's scheduling policy before it stamps: a
    priority-scheduled engine gets admission priorities (the warm session passes the queue),
    a first-come-first-served one gets none."""
    sim = {"scheduling_policy": policy, "max_num_seqs": 1}
    monkeypatch.setattr(proxy.forward, "SLACK_MS_PER_KTOK", 10_000.0)
    async with sim_stack(redis_server.url, namespace, num_blocks=400, speed=5, sim=sim) as st:
        _, es = _engine_state(st)
        assert await wait_for(lambda: _told(es)), "the engine's policy was never read"
        assert es.adapter.prioritized == (policy == "priority")
        done = await _warm_after_cold(st)
        stamped = await st.metric("kvkeeper_admission_slack_seconds_count")
        if policy == "priority":
            assert stamped == 5 and done == ["cold0", "warm", "cold1", "cold2"]
        else:
            assert stamped == 0 and done == ["cold0", "cold1", "cold2", "warm"]


async def _told(es) -> bool:  # type: ignore[no-untyped-def]
    return es.adapter.scheduling_policy is not None


async def test_the_guard_backs_off_when_retention_costs_more_than_it_bought(
    redis_server: RedisServer, namespace: str
) -> None:
    """A warm-up re-prefills an evicted session that never comes back: retention's measured
    balance on the engine turns negative, and the guard holds it back (warm-ups refused,
    touches and pins paused), visible in the metrics and /admin/engines."""
    async with sim_stack(redis_server.url, namespace, num_blocks=400) as st:
        _guard(st, GuardConfig(min_evidence_tokens=1000, cooldown_s=600, max_cooldown_s=600))
        await st.complete(prompt(1), {"session_id": "w"})  # 63 blocks
        await _known_blocks(st, "w")
        _, es = _engine_state(st)
        assert await wait_for(lambda: _loaded(es)), "engine load never scraped"
        await _flood(st, n=14)  # LRU takes the session's blocks
        first = (await st.manage("w", "prefetch"))["results"][0]
        assert first["status"] == "applied", first  # re-prefilled: about 2,000 tokens
        assert first["detail"]["cached_tokens"] < 0.5 * FULL
        admin = {"Authorization": "Bearer admin-secret"}
        view = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        guard_view = view["data"][0]["retention"]["guard"]
        assert guard_view["cost_tokens"] > 1000 and guard_view["bought_tokens"] == 0
        second = (await st.manage("w", "prefetch"))["results"][0]
        assert second["status"] == "rejected" and second["reason"] == "retention_backed_off"
        assert second["detail"]["state"] == "backed_off" and second["detail"]["balance_tokens"] < 0
        assert await st.metric("kvkeeper_retention_guard_backed_off") == 1
        assert await st.metric("kvkeeper_retention_guard_backoffs_total") == 1
        assert await st.metric("kvkeeper_retention_guard_cost_tokens_total") > 1000
        view = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        guard_view = view["data"][0]["retention"]["guard"]
        assert guard_view["state"] == "backed_off" and guard_view["backoffs"] == 1


def _guard(st, config: GuardConfig) -> None:  # type: ignore[no-untyped-def]
    retention, _ = _engine_state(st)
    assert retention.guards is not None
    retention.guards.configure(config)


async def test_the_guard_credits_the_hits_a_warm_up_bought(
    redis_server: RedisServer, namespace: str
) -> None:
    """A warm-up brings an evicted session back and the session resumes on it: the tokens it
    kept are credited as bought, and retention stays on."""
    async with sim_stack(redis_server.url, namespace, num_blocks=400) as st:
        _guard(st, GuardConfig(min_evidence_tokens=1000, queue_weight=0.0))
        await st.complete(prompt(1), {"session_id": "w"})
        await _known_blocks(st, "w")
        _, es = _engine_state(st)
        assert await wait_for(lambda: _loaded(es)), "engine load never scraped"
        await _flood(st, n=14)
        warm = (await st.manage("w", "prefetch"))["results"][0]
        assert warm["status"] == "applied", warm
        resumed = await st.complete(prompt(1) + [7] * 100, {"session_id": "w"})
        assert cached(resumed) >= 0.95 * FULL
        bought = await st.metric("kvkeeper_retention_guard_bought_tokens_total")
        assert bought >= 0.95 * FULL
        admin = {"Authorization": "Bearer admin-secret"}
        view = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        guard_view = view["data"][0]["retention"]["guard"]
        assert guard_view["state"] == "active" and guard_view["bought_tokens"] >= 0.95 * FULL
        # the flood evicted the session: its pause outlasted the LRU horizon
        assert guard_view["resumes_credited"] == 1 and guard_view["within_horizon_tokens"] == 0


async def test_the_guard_credits_nothing_for_a_resume_within_the_lru_horizon(
    redis_server: RedisServer, namespace: str
) -> None:
    """A warm-up refreshes a session LRU still holds and it resumes at once: it would have hit
    without retention, so nothing is credited (the hit shows as within the horizon)."""
    async with sim_stack(redis_server.url, namespace, num_blocks=400) as st:
        _guard(st, GuardConfig(min_evidence_tokens=1000, queue_weight=0.0))
        await st.complete(prompt(1), {"session_id": "w"})
        await _known_blocks(st, "w")
        _, es = _engine_state(st)
        assert await wait_for(lambda: _loaded(es)), "engine load never scraped"
        warm = (await st.manage("w", "prefetch"))["results"][0]
        assert warm["status"] == "applied", warm
        resumed = await st.complete(prompt(1) + [7] * 100, {"session_id": "w"})
        assert cached(resumed) >= 0.95 * FULL
        assert await st.metric("kvkeeper_retention_guard_bought_tokens_total") == 0
        within = await st.metric("kvkeeper_retention_guard_within_horizon_tokens_total")
        assert within >= 0.95 * FULL
        admin = {"Authorization": "Bearer admin-secret"}
        view = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        guard_view = view["data"][0]["retention"]["guard"]
        assert guard_view["bought_tokens"] == 0 and guard_view["resumes_within_horizon"] == 1
        assert guard_view["total_within_horizon_tokens"] >= 0.95 * FULL


async def test_one_huge_touch_recompute_does_not_silence_retention(
    redis_server: RedisServer, namespace: str
) -> None:
    """The engine loses a protected session's prefix before kvkeeper hears of it (its cache is
    reset; the event waits for the engine's next step), as when a touch races LRU: the touch
    re-prefills all 2,017 tokens, seven buckets' worth. The bucket keeps one bucket of debt,
    the guard is charged the whole recompute, and once traffic has paid the debt touches are
    admitted again, at one recomputed token each. (Before: the outlier priced every later
    touch above what a full bucket holds, so none was sent for the rest of the run.)"""
    async with sim_stack(redis_server.url, namespace, tick_s=3600) as st:  # ticks by hand
        await _protected(st, "s")
        await _known_blocks(st, "s")
        retention, es = _engine_state(st)
        key = SessionKey("default", "s")
        session = await retention.store.get("default", "s")
        assert session is not None
        blocks = await retention.blocks.blocks_of(key, session)

        async def resident() -> bool:
            return es.signals.resident(blocks) == len(blocks)

        assert await wait_for(resident), "the session's blocks were never reported stored"
        budget = es.signals.overhead = OverheadBudget(OverheadConfig(share=0.5, burst_tokens=300))

        async def touched() -> float:
            """One retention pass over the session (due now); its touch's recompute, or -1
            when it was declined over budget."""
            declined = budget.declined
            retention._touch(es, [session], {key: blocks}, 0.0, time.time())
            if budget.declined > declined:
                return -1.0
            assert key in es.in_flight

            async def done() -> bool:
                return key not in es.in_flight

            assert await wait_for(done), "the touch never ended"
            return await st.metric("kvkeeper_touch_recomputed_tokens_total")

        assert await touched() <= BLOCK  # resident: the touch recomputes its last token
        assert st.sim.engine.reset_prefix_cache()
        before = await st.metric("kvkeeper_touch_recomputed_tokens_total")
        assert await touched() - before >= FULL  # the accident
        assert budget.credit == -300 and budget.forgiven > 1000
        guard = retention.guards.view(es.name, time.time()) if retention.guards else {}
        assert guard["total_cost_tokens"] >= FULL and guard["state"] == "active"
        assert await wait_for(resident), "the re-prefilled blocks were never reported stored"
        assert await touched() == -1.0  # in debt: declined until traffic pays
        for i in range(4):  # 1,604 prompt tokens served: half of them earn credit
            await st.complete(prompt(500 + i, n=401))
        await es.signals.scrape(time.time(), max_age_s=0.0)
        for _ in range(3):  # touches run again, each at one recomputed token
            before = await st.metric("kvkeeper_touch_recomputed_tokens_total")
            after = await touched()
            assert after >= 0, (budget.credit, budget.touch_estimate)
            assert after - before <= BLOCK
            await st.complete(prompt(600, n=401))
            await es.signals.scrape(time.time(), max_age_s=0.0)
        assert budget.touch_estimate < 0.5 * budget.config.burst_tokens


async def test_prefetch_without_a_tier_warms_only_what_fits(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace) as st:  # 200-block pool, no tier
        await st.complete(prompt(1), {"session_id": "w"})  # 63 blocks, not protected
        await _known_blocks(st, "w")
        _, es = _engine_state(st)
        assert await wait_for(lambda: _loaded(es)), "engine load never scraped"
        result = (await st.manage("w", "prefetch"))["results"][0]
        assert result["status"] == "applied" and result["detail"]["cached_tokens"] >= 0.95 * FULL
        warmed = await st.metric("kvkeeper_warmup_prompt_tokens_total")
        await _flood(st)  # LRU takes all 63 blocks: re-prefilling them is 31% of the pool
        result = (await st.manage("w", "prefetch"))["results"][0]
        assert result["status"] == "rejected" and result["reason"] == "exceeds_prefetch_budget"
        assert result["detail"]["missing_blocks"] == 63 and result["detail"]["limit_blocks"] == 50
        assert await st.metric("kvkeeper_warmup_prompt_tokens_total") == warmed  # none sent


async def _loaded(es) -> bool:  # type: ignore[no-untyped-def]
    return es.signals.load is not None


async def test_prefetch_with_a_tier_counts_what_the_tier_kept(
    redis_server: RedisServer, namespace: str
) -> None:
    # a tier of 8 chunks (2,048 tokens): the flood pushes out of it whatever is not pinned
    async with sim_stack(redis_server.url, namespace, cpu_blocks=64) as st:
        for sid, seed in (("kept", 1), ("lost", 2)):
            await st.complete(prompt(seed), {"session_id": sid})
            await _known_blocks(st, sid)
        _, es = _engine_state(st)
        assert await wait_for(lambda: _loaded(es)), "engine load never scraped"
        offload = (await st.manage("kept", "offload"))["results"][0]
        assert offload["status"] == "applied", offload  # its 7 chunks pinned in the tier
        await _flood(st)  # the GPU loses both sessions, the tier keeps only the pinned one
        kept = (await st.manage("kept", "prefetch"))["results"][0]
        assert kept["status"] == "applied", kept
        assert kept["detail"]["tier_tokens"] == 7 * 256
        assert kept["detail"]["cached_tokens"] >= 7 * 256  # loaded from the tier
        lost = (await st.manage("lost", "prefetch"))["results"][0]
        assert lost["status"] == "rejected" and lost["reason"] == "exceeds_prefetch_budget", lost
        assert lost["detail"]["tier_tokens"] == 0 and lost["detail"]["missing_blocks"] == 63


async def test_a_touch_the_engine_serves_late_is_never_aborted(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM with an asynchronous KV connector (LMCache) dies when a request it is loading KV for
    # is aborted (vllm-project/vllm#43226): a touch kvkeeper sent runs to its end however long
    # the engine takes, and is then counted late, with what it refreshed and recomputed. Here
    # the engine is slowed down until a touch takes several times TOUCH_LATE_S.
    monkeypatch.setattr(proxy.touches, "TOUCH_LATE_S", 0.2)
    async with sim_stack(redis_server.url, namespace, tick_s=3600) as st:
        retention, es, session, blocks = await _protected(st, "slow")
        assert len(blocks) == 63

        # the touch re-sends what the KV events show resident: wait for all of it (events from
        # the simulator can trail the response on a loaded machine; none yet: a lost prefix)
        async def resident() -> bool:
            return es.signals.resident_prefix(blocks) == 63

        assert await wait_for(resident), es.signals.resident_prefix(blocks)
        engine = st.sim.engine
        fast = engine.config
        engine.config = replace(fast, speed=fast.speed / 200)
        try:
            started = time.monotonic()
            async with asyncio.timeout(30):
                await retention.touches.touch_session(es, session)
            took = time.monotonic() - started
        finally:
            engine.config = fast
        assert took > 0.2, took
        assert engine.stats.finished.get("abort", 0) == 0, engine.stats.finished
        assert await st.metric("kvkeeper_touches_total", label='outcome="late"') == 1
        assert await st.metric("kvkeeper_touches_total", label='outcome="ok"') == 0
        assert await st.metric("kvkeeper_touch_prompt_tokens_total") >= 63 * 32


async def test_stopping_retention_lets_touches_in_flight_finish(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kvkeeper that stops (a rolling restart) lets its touches end instead of aborting them
    on the engine, within the grace it gives them."""
    async with sim_stack(redis_server.url, namespace, tick_s=3600) as st:
        retention, es, session, _ = await _protected(st, "stopping")
        engine = st.sim.engine
        arrived: list[object] = []
        add_request = engine.add_request

        def counted(*args: object, **kwargs: object) -> object:
            arrived.append(add_request(*args, **kwargs))  # type: ignore[arg-type]
            return arrived[-1]

        monkeypatch.setattr(engine, "add_request", counted)
        fast = engine.config
        engine.config = replace(fast, speed=fast.speed / 200)
        try:
            retention.touches.spawn_session(es, session, 0.0)

            async def reached() -> bool:
                return bool(arrived)

            assert await wait_for(reached), "the touch never reached the engine"
            async with asyncio.timeout(30):
                await retention.stop()
        finally:
            engine.config = fast
        assert engine.stats.finished.get("abort", 0) == 0, engine.stats.finished
        assert not retention.touches.tasks()


async def test_the_block_ids_of_sessions_the_store_dropped_are_forgotten(
    redis_server: RedisServer, namespace: str
) -> None:
    """Each replica's cache of learned block ids loses the sessions whose records are gone
    (freed by an edit or by another replica, expired idle), so it does not grow with every
    session ever seen, and evict no longer keeps chunks for a session that ended."""
    async with sim_stack(redis_server.url, namespace, tick_s=3600) as st:
        for sid, seed in (("a", 1), ("b", 1), ("c", 2)):  # a and b recorded the same context
            await st.complete(prompt(seed), {"session_id": sid})
            await _known_blocks(st, sid)
        retention, _ = _engine_state(st)
        blocks = retention.blocks.known(SessionKey("default", "a"))
        assert (
            retention.blocks.shared_prefix(SessionKey("default", "a"), blocks) == 63
        )  # b starts with them
        store = retention.store
        assert await store.free("default", "b") == ["b"]
        await store.redis.delete(store.key("s", "default", "c"))  # as its idle expiry does
        assert len(await retention.blocks.prune(time.time())) == 0  # not due yet
        assert len(await retention.blocks.prune(time.time() + PRUNE_EVERY_S)) == 2
        assert retention.blocks.known(SessionKey("default", "b")) == retention.blocks.known(
            SessionKey("default", "c")
        )
        assert retention.blocks.known(SessionKey("default", "c")) == ()
        assert retention.blocks.known(SessionKey("default", "a")) == blocks  # alive: kept
        assert retention.blocks.shared_prefix(SessionKey("default", "a"), blocks) == 0


async def test_block_ids_the_engine_failed_to_give_are_asked_for_again(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenize that fails (the engine busy or restarting) is not remembered as "no blocks"
    for the session's context: that left a protected session untouched and unpinned until its
    next request. It is asked again after ``LEARN_RETRY_S``, not on every tick."""
    monkeypatch.setattr(proxy.block_cache, "LEARN_RETRY_S", 0.2)
    async with sim_stack(redis_server.url, namespace, tick_s=3600) as st:
        await st.complete(prompt(1), {"session_id": "a"})
        await st.runtime().settle()
        retention, es = _engine_state(st)
        real, calls = es.adapter.tokenize, []

        async def flaky(route: str, body: dict[str, object]) -> list[int]:
            calls.append(route)
            if len(calls) == 1:
                raise AdapterError("engine busy")
            return await real(route, body)

        monkeypatch.setattr(es.adapter, "tokenize", flaky)
        assert await retention.blocks.blocks_of(SessionKey("default", "a")) == ()
        assert (
            await retention.blocks.blocks_of(SessionKey("default", "a")) == ()
        )  # within the retry delay
        assert len(calls) == 1
        await asyncio.sleep(0.25)
        assert len(await retention.blocks.blocks_of(SessionKey("default", "a"))) == 63
        assert len(calls) == 2


async def test_prefetch_waits_out_a_busy_engine(redis_server: RedisServer, namespace: str) -> None:
    """A warm-up that must re-prefill is declined while requests wait at the engine: it would
    only move the resume's compute ahead of theirs. Once the queue drains it runs."""
    async with sim_stack(redis_server.url, namespace) as st:  # 200-block pool, no tier
        await st.complete(prompt(1, 1000), {"session_id": "w"})  # 31 blocks
        await _known_blocks(st, "w", n=31)
        await _flood(st)  # LRU takes them: a warm-up would re-prefill 31 blocks (fits the budget)
        fast = st.sim.engine.config
        st.sim.engine.config = replace(fast, speed=4.0)  # 5x slower: requests queue up
        queued = [asyncio.create_task(st.complete(prompt(300 + i))) for i in range(4)]

        _retention, es = _engine_state(st)

        async def waiting() -> bool:  # as kvkeeper reads it (at most half a second old)
            load = await es.signals.fresh_load()
            return load is not None and (load.waiting or 0) > 0 and len(st.sim.engine.waiting) > 0

        assert await wait_for(waiting), "nothing ever waited at the engine"
        busy = (await st.manage("w", "prefetch"))["results"][0]
        assert busy["status"] == "rejected" and busy["reason"] == "engine_busy", busy
        assert busy["detail"]["waiting"] >= 1 and busy["detail"]["missing_blocks"] == 31
        assert await st.metric("kvkeeper_warmup_prompt_tokens_total") == 0  # none sent
        st.sim.engine.config = fast
        await asyncio.gather(*queued)
        await asyncio.sleep(0.6)  # the load reading ages past its half second
        idle = (await st.manage("w", "prefetch"))["results"][0]
        assert idle["status"] == "applied", idle


@pytest.mark.parametrize(("share", "burst"), [(0.01, 64), (1e-6, 0)])
async def test_retention_recomputes_no_more_than_its_share_of_served_prompt_tokens(
    redis_server: RedisServer,
    namespace: str,
    share: float,
    burst: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The overhead budget (``max_overhead_share``): at 1% of the prompt tokens served, in a
    64-token bucket, touches of a resident prefix (a token each) fit, and the protected session
    survives a flood; the re-prefill of an evicted session (31 blocks, about 1,000 tokens) does
    not fit, so its warm-up is declined. With no bucket and 0.0001% no touch fits: the
    protection lapses, and the clients' requests are served as ever."""
    monkeypatch.setattr(proxy.retention, "OVERHEAD_BURST_TOKENS", burst)
    async with sim_stack(redis_server.url, namespace, max_overhead_share=share) as st:
        served = (
            await st.complete(prompt(1), {"session_id": "kept", "cache_control": {"ttl": 300}})
        )["usage"]["prompt_tokens"]
        served += (await st.complete(prompt(2, 1000), {"session_id": "w"}))["usage"][
            "prompt_tokens"
        ]
        await _known_blocks(st, "kept")
        await _known_blocks(st, "w", n=31)
        served += await _flood(st)
        kept = cached(await st.complete(prompt(1), {"session_id": "kept"}))
        _retention, es = _engine_state(st)

        async def idle() -> bool:  # a touch still queued would decline it as engine_busy
            load = await es.signals.fresh_load()
            return load is not None and not load.waiting

        assert await wait_for(idle), "the engine kept a request waiting"
        warm = (await st.manage("w", "prefetch"))["results"][0]
        assert warm["status"] == "rejected" and warm["reason"] == "exceeds_overhead_budget", warm
        assert warm["detail"]["recompute_tokens"] == 31 * BLOCK + 1
        assert await st.metric("kvkeeper_warmup_prompt_tokens_total") == 0  # none sent
        admin = {"Authorization": "Bearer admin-secret"}
        engines = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        overhead = engines["data"][0]["retention"]["overhead"]
        recomputed = await st.metric("kvkeeper_touch_recomputed_tokens_total")
        assert overhead["max_share"] == share and overhead["recomputed_tokens"] == recomputed
        # within the share of what was served, give or take one touch's misestimate, plus what
        # the debt cap forgave (a touch that raced the flood overshot by more than a bucket)
        forgiven = overhead["forgiven_tokens"]
        assert recomputed <= share * served + burst + forgiven + BLOCK, (recomputed, served)
        declined = await st.metric("kvkeeper_touches_total", label='outcome="over_budget"')
        # served touches: on time or late (a loaded machine can make one late; it still ran)
        ran = sum(
            [
                await st.metric("kvkeeper_touches_total", label=f'outcome="{o}"')
                for o in ("ok", "late")
            ]
        )
        if share == 0.01:
            assert kept >= 0.95 * FULL, (kept, overhead, declined, served)
            assert ran >= 1
        else:
            assert kept == 0
            assert ran == 0
            assert declined >= 1 and overhead["declined"] >= declined


async def test_traffic_that_reached_the_engine_another_way_earns_retention_credit(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The credit follows the engine's own prefix-cache query counter, so traffic another
    kvkeeper replica (or any client) sent the engine counts too, less retention's own."""
    monkeypatch.setattr(proxy.retention, "OVERHEAD_BURST_TOKENS", 10**6)
    async with sim_stack(redis_server.url, namespace, max_overhead_share=0.01) as st:
        _, es = _engine_state(st)

        async def read() -> bool:
            return es.signals.queries_seen is not None

        assert await wait_for(read), "the engine's counter was never read"
        es.signals.overhead.credit = 0.0
        sent = 0
        async with aiohttp.ClientSession() as http:
            for i in range(3):  # straight to the engine, not through this proxy
                body = {"model": "sim", "prompt": prompt(500 + i), "max_tokens": 1}
                async with http.post(st.sim.url + "/v1/completions", json=body) as resp:
                    sent += (await resp.json())["usage"]["prompt_tokens"]

        async def earned() -> bool:
            return es.signals.overhead.credit >= 0.01 * sent

        assert await wait_for(earned), (es.signals.overhead.credit, sent)
        assert es.signals.overhead.credit <= 0.01 * sent + 1
        admin = {"Authorization": "Bearer admin-secret"}
        engines = await (await st.proxy.get("/admin/engines", headers=admin)).json()
        assert engines["data"][0]["retention"]["overhead"]["earned_from"] == "engine"
