"""The simulator's scheduler: chunked prefill, preemption, CPU tier, timing (engine only)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
from aiohttp import web

from adapters.block_hash import BlockHasher
from adapters.vllm import PRIORITY_HEADER
from loadgen.sim.api import GenParams
from loadgen.sim.block_pool import MEDIUM_CPU, BlockRemoved, BlockStored, KVEvent
from loadgen.sim.cpu_tier import CpuTier
from loadgen.sim.engine import EngineConfig, EngineRejected, Finished, SimEngine, SimRequest
from loadgen.sim.profiles import INSTANT, Profile, get_profile
from loadgen.sim.tokenizer import SimTokenizer

REPLY = [11, 12, 13]


Factory = Callable[..., tuple[SimEngine, list[KVEvent]]]


@pytest.fixture
async def make_engine() -> AsyncIterator[Factory]:
    engines: list[SimEngine] = []

    def factory(profile: Profile = INSTANT, **kw: int | float) -> tuple[SimEngine, list[KVEvent]]:
        published: list[KVEvent] = []
        engine = SimEngine(EngineConfig(**kw), profile, published.extend)  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine, published

    yield factory
    for engine in engines:
        await engine.stop()


async def drain(req: SimRequest) -> list[int]:
    out: list[int] = []
    while not isinstance(item := await asyncio.wait_for(req.outputs.get(), 10), Finished):
        out.append(item)
    return out


async def test_cached_tokens_rise_on_repeat_and_cap_at_len_minus_one(make_engine: Factory) -> None:
    engine, _ = make_engine(num_blocks=64, block_size=32)
    prompt = list(range(1000, 1000 + 96))  # exactly 3 blocks
    r1 = engine.add_request(prompt, max_tokens=2, reply=REPLY)
    assert await drain(r1) == [11, 12]
    r2 = engine.add_request(prompt, max_tokens=2, reply=REPLY)
    await drain(r2)
    assert (r1.num_cached_tokens, r2.num_cached_tokens) == (0, 64)
    assert r1.finish_reason == "length"


async def test_reply_stops_after_reply_tokens_unless_ignore_eos(make_engine: Factory) -> None:
    engine, _ = make_engine(num_blocks=64, reply_tokens=4)
    a = engine.add_request([1, 2, 3], max_tokens=None, reply=REPLY)
    b = engine.add_request([1, 2, 3], max_tokens=7, ignore_eos=True, reply=REPLY)
    assert await drain(a) == [11, 12, 13, 11]
    assert await drain(b) == [11, 12, 13, 11, 12, 13, 11]
    assert (a.finish_reason, b.finish_reason) == ("stop", "length")


async def test_long_prompt_is_chunked_by_the_token_budget(make_engine: Factory) -> None:
    engine, published = make_engine(num_blocks=64, block_size=32, max_num_batched_tokens=256)
    prompt = list(range(700))
    await drain(engine.add_request(prompt, max_tokens=1, reply=REPLY))
    stored = [e for e in published if isinstance(e, BlockStored)]
    # 700 tokens in chunks of 256, 256, 188: full blocks cached per chunk = 8, 8, 5
    assert [len(e.block_hashes) for e in stored] == [8, 8, 5]
    flat = [h for e in stored for h in e.block_hashes]
    assert flat == BlockHasher(32, "0").block_ids(prompt)
    assert stored[1].parent_block_hash == flat[7]


async def test_preemption_when_the_running_batch_cannot_grow(make_engine: Factory) -> None:
    # 4 usable blocks of 4 tokens; two requests of 6 prompt + 8 output tokens need 4 blocks each
    engine, _ = make_engine(num_blocks=5, block_size=4)
    a = engine.add_request(list(range(10, 16)), max_tokens=8, ignore_eos=True, reply=REPLY)
    b = engine.add_request(list(range(20, 26)), max_tokens=8, ignore_eos=True, reply=REPLY)
    out_a, out_b = await asyncio.gather(drain(a), drain(b))
    assert len(out_a) == len(out_b) == 8
    assert engine.stats.preemptions >= 1
    assert b.num_preemptions >= 1  # the last running request is the victim
    assert a.num_preemptions == 0
    assert engine.pool.num_free == 4


async def test_prompt_longer_than_the_pool_is_rejected(make_engine: Factory) -> None:
    engine, _ = make_engine(num_blocks=5, block_size=4)
    with pytest.raises(EngineRejected):
        engine.add_request(list(range(16)), max_tokens=1, reply=REPLY)


async def test_abort_frees_blocks(make_engine: Factory) -> None:
    engine, _ = make_engine(num_blocks=64)
    req = engine.add_request(list(range(100)), max_tokens=10_000, ignore_eos=True, reply=REPLY)
    await req.outputs.get()
    engine.abort(req)
    assert req.finish_reason == "abort"
    assert engine.pool.num_free == 63
    assert not engine.busy


async def test_cpu_tier_loads_back_what_the_device_evicted(make_engine: Factory) -> None:
    engine, published = make_engine(num_blocks=20, block_size=32, cpu_blocks=64)
    a = list(range(10_000, 10_512))  # 2 chunks, 16 blocks
    flood = list(range(50_000, 50_512))
    await drain(engine.add_request(a, max_tokens=1, reply=REPLY))
    await drain(engine.add_request(flood, max_tokens=1, reply=REPLY))  # evicts a from device
    again = engine.add_request(a, max_tokens=1, reply=REPLY)
    await drain(again)
    # device hit: whatever of a survived (3 blocks at the head of a's chain); the rest comes
    # from the CPU tier (both chunks stored), capped at len - 1 = 511 tokens
    assert again.num_cached_tokens == 511
    assert again.num_external_tokens == 511 - engine.kv.stats.hits
    assert engine.stats.external_hits == again.num_external_tokens
    # counted once a request is admitted, like vLLM's connector stats: queries are what the
    # local cache did not hold, over the three requests
    assert engine.stats.external_queries == 3 * 512 - engine.kv.stats.hits
    cpu_stored = [e for e in published if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert len(cpu_stored) == 4  # a's 2 chunks + flood's 2 chunks
    assert cpu_stored[0].block_hashes == BlockHasher(32, "0").block_ids(a)[:8]


async def test_cpu_tier_keys_are_hashed_once_per_request(make_engine: Factory) -> None:
    # a request that waits at the head of the queue looks the tier up at every step: its chunk
    # keys are hashed once (they cost real time, which the simulator's clock would count)
    engine, _ = make_engine(num_blocks=20, block_size=32, cpu_blocks=64)
    tier = engine.cpu
    assert tier is not None
    hashed: list[int] = []
    lookups: list[int] = []
    chunk_keys, lookup_sources = tier.chunk_keys, tier.lookup_sources

    def counting_keys(tokens: Sequence[int], salt: str | None) -> list[str]:
        hashed.append(len(tokens))
        return chunk_keys(tokens, salt)

    def counting_lookup(
        tokens: Sequence[int], salt: str | None, keys: Sequence[str] | None = None
    ) -> list[bool]:
        lookups.append(len(tokens))
        return lookup_sources(tokens, salt, keys)

    tier.chunk_keys = counting_keys  # type: ignore[method-assign]
    tier.lookup_sources = counting_lookup  # type: ignore[method-assign]
    # 18 of the 19 usable blocks, 19 with its 30 output tokens: the waiter (16 blocks) waits
    hog = engine.add_request(
        list(range(20_000, 20_560)), max_tokens=30, ignore_eos=True, reply=REPLY
    )
    await hog.outputs.get()
    waiter = engine.add_request(list(range(30_000, 30_512)), max_tokens=1, reply=REPLY)
    await asyncio.gather(drain(hog), drain(waiter))
    assert lookups.count(512) > 5  # looked up at every step it waited
    assert hashed.count(512) == 1  # ... and at its store: hashed once
    # the connector's stats count each request once, when admitted (as vLLM does), not at
    # every look-up while it waited
    assert engine.stats.external_queries == 560 + 512


def test_cpu_tier_lru_respects_pins() -> None:
    events: list[KVEvent] = []
    tier = CpuTier(2, 32, "0", events)
    x, y, z = ([i] * 256 for i in (1, 2, 3))
    hx = BlockHasher(32, "0").digests(x)
    hy = BlockHasher(32, "0").digests(y)
    hz = BlockHasher(32, "0").digests(z)
    assert tier.store(x, hx, None) == 1
    assert tier.store(y, hy, None) == 1
    assert tier.pin(x, None) == 1
    assert tier.store(z, hz, None) == 1  # evicts y (x is pinned though older)
    assert tier.lookup_prefix(x, None) == 256
    assert tier.lookup_prefix(y, None) == 0
    assert tier.lookup_prefix(z, None) == 256
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed[0].block_hashes == BlockHasher(32, "0").block_ids(y)
    assert removed[0].medium == MEDIUM_CPU
    assert tier.pin(x, None) == 1  # pin count 2
    assert tier.unpin(x, None) == 1
    assert tier.pins == {tier.chunk_keys(x, None)[0]: 1}
    tier.unpin(x, None)
    assert tier.store(y, hy, None) == 1  # x is evictable again: LRU order x (older), z
    assert tier.lookup_prefix(x, None) == 0


def test_cpu_tier_with_an_l2_pins_protect_l2_and_l1_stays_lru() -> None:
    """LMCache MP's two levels: L1 evicts by LRU whatever is pinned, every chunk is written
    through to L2, whose eviction skips pinned chunks; a chunk found only in L2 is loaded back
    into L1, and ``/cache/clear`` empties L1 only."""
    events: list[KVEvent] = []
    tier = CpuTier(2, 32, "0", events, l2_capacity_chunks=2)
    hasher = BlockHasher(32, "0")
    x, y, z = ([i] * 256 for i in (1, 2, 3))
    for chunk in (x, y):
        assert tier.store(chunk, hasher.digests(chunk), None) == 1
    tier.pin(x, None)
    assert tier.store(z, hasher.digests(z), None) == 1
    key = {name: tier.chunk_keys(c, None)[0] for name, c in (("x", x), ("y", y), ("z", z))}
    assert list(tier.chunks) == [key["y"], key["z"]]  # L1: x went first, pinned or not
    assert list(tier.l2) == [key["x"], key["z"]]  # L2: y went, x is pinned
    assert tier.lookup_sources(x, None) == [True]  # from L2, back into L1 (y leaves L1)
    assert list(tier.chunks) == [key["z"], key["x"]]
    assert tier.lookup_sources(y, None) == []  # in neither level now
    assert tier.lookup_sources(z, None) == [False]
    assert tier.clear() == 2
    assert tier.lookup_prefix(z, None) == 256  # L2 kept its copy (now loaded into L1 again)
    assert tier.remove(key["z"], "l2") and tier.holds(key["z"])  # still in L1
    assert tier.remove(key["z"]) and not tier.holds(key["z"])
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 5  # x, y, z stored; x and z loaded back into L1


async def test_l2_loads_are_charged_at_the_l2_rate(make_engine: Factory) -> None:
    """Tokens the tier loads from L2 reach the step's timing as such."""
    engine, _ = make_engine(num_blocks=20, block_size=32, cpu_blocks=16, cpu_l2_blocks=64)
    steps: list[dict[str, float]] = []
    profile = engine.profile

    class Recording:
        def __getattr__(self, name: str) -> object:
            return getattr(profile, name)

        def step_seconds(self, **kw: float) -> float:
            steps.append(kw)
            return 0.0

    engine.profile = Recording()  # type: ignore[assignment]
    a = list(range(10_000, 10_512))  # 2 chunks: the whole of L1
    await drain(engine.add_request(a, max_tokens=1, reply=REPLY))
    await drain(engine.add_request(list(range(50_000, 50_512)), max_tokens=1, reply=REPLY))
    again = engine.add_request(a, max_tokens=1, reply=REPLY)
    await drain(again)
    assert again.num_external_tokens > 0  # the flood took a from the device and from L1
    loads = [s for s in steps if s["loaded_tokens"]]
    assert [(s["loaded_tokens"], s["l2_loaded_tokens"]) for s in loads] == [
        (again.num_external_tokens, again.num_external_tokens)
    ]
    assert loads[0]["l2_load_factor"] == 4.0
    h100 = get_profile("h100-llama8b")
    l1_only = h100.step_seconds(prefill_tokens=0, cached_tokens=0, loaded_tokens=100, decodes=0)
    from_l2 = h100.step_seconds(
        prefill_tokens=0, cached_tokens=0, loaded_tokens=100, decodes=0,
        l2_loaded_tokens=100, l2_load_factor=4.0,
    )  # fmt: skip
    assert from_l2 - h100.step_overhead_s == pytest.approx(4 * (l1_only - h100.step_overhead_s))


async def test_cpu_profile_timing_matches_the_measured_engine(make_engine: Factory) -> None:
    """cpu-smollm2 at speed 20: cold 2,000 tokens ~4.4 s real, cached ~0.14 s real."""
    speed = 20.0
    engine, _ = make_engine(
        get_profile("cpu-smollm2"), num_blocks=200, max_num_batched_tokens=2048, speed=speed
    )
    prompt = list(range(2000))
    t0 = time.perf_counter()
    await drain(engine.add_request(prompt, max_tokens=1, reply=REPLY))
    cold = (time.perf_counter() - t0) * speed
    t0 = time.perf_counter()
    await drain(engine.add_request(prompt, max_tokens=1, reply=REPLY))
    warm = (time.perf_counter() - t0) * speed
    assert 3.8 < cold < 5.5
    assert 0.08 < warm < 0.4


@pytest.mark.parametrize(
    ("max_lag_s", "work_s", "wall_s", "lag_s"),
    [
        (0.0, 0.01, 0.58, 0.19),  # every step's own processing time adds to it
        (1.0, 0.01, 0.39, 0.0),  # absorbed: the modelled clock holds
        (0.05, 0.03, 0.6, 0.16),  # more work than the steps model: caught up to 50 ms, then late
    ],
)
async def test_steps_keep_the_modelled_clock_within_the_lag_allowed(
    make_engine: Factory, max_lag_s: float, work_s: float, wall_s: float, lag_s: float
) -> None:
    """A prefill step that costs nothing, then 19 decode steps of 20 ms; after each step the
    simulator itself works for ``work_s`` of wall time (what streaming and bookkeeping cost
    it). The request takes the modelled 0.38 s when that work fits in the steps and the lag
    allowed; the part that does not is counted as lag."""
    profile = Profile("decode-20ms", 0.0, 0.0, 0.0, 0.02, 0.0, 0.0, 1)
    engine, _ = make_engine(profile, num_blocks=64, max_lag_s=max_lag_s)
    update = engine._update

    def working_update(plan: object, now: float) -> None:
        update(plan, now)  # type: ignore[arg-type]
        time.sleep(work_s)  # blocks the loop, as the simulator's own Python work does

    engine._update = working_update  # type: ignore[method-assign]
    t0 = time.perf_counter()
    await drain(engine.add_request([1, 2, 3], max_tokens=20, ignore_eos=True, reply=REPLY))
    took = time.perf_counter() - t0
    assert engine.stats.modelled_s == pytest.approx(0.38)
    # at least the work that could not be absorbed; more on a loaded machine (the loop's own
    # overhead counts too), but never any when everything fits in the lag allowed
    assert lag_s - 0.03 <= engine.stats.lag_s <= lag_s + 0.1
    if lag_s == 0.0:
        assert engine.stats.lag_s == 0.0
    assert wall_s - 0.03 < took < wall_s + 0.15


async def test_catching_up_never_starts_a_requests_first_step_before_it_arrived(
    make_engine: Factory,
) -> None:
    """A decodes while the simulator falls behind its modelled clock (30 ms of its own work
    after every 20 ms step); B arrives then, with a prefill modelled at 50 ms. Catching up
    runs A's late steps back to back, but B's first token still comes a whole modelled step
    (B's prefill and A's decode, 70 ms) after B arrived."""
    profile = Profile("prefill-10ms-decode-20ms", 0.01, 0.0, 0.0, 0.02, 0.0, 0.0, 1)
    engine, _ = make_engine(profile, num_blocks=64, max_lag_s=1.0)
    update = engine._update

    def working_update(plan: object, now: float) -> None:
        update(plan, now)  # type: ignore[arg-type]
        time.sleep(0.03)

    engine._update = working_update  # type: ignore[method-assign]
    a = engine.add_request([1], max_tokens=60, ignore_eos=True, reply=REPLY)
    for _ in range(10):  # A's first ten tokens: the clock is behind by then
        await a.outputs.get()
    assert a.finish_reason is None  # B shares its steps
    b = engine.add_request([2, 3, 4, 5, 6], max_tokens=1, reply=REPLY)
    await drain(b)
    await drain(a)
    assert b.first_token_at is not None
    assert b.first_token_at - b.arrival >= 0.07 - 0.005


def test_tokenizer_round_trips_and_chat_prefixes_are_stable() -> None:
    tok = SimTokenizer()
    text = "Hello, world!  tabs\tand\nnewlines, ünïcödé 中文 🎉"
    assert tok.decode(tok.encode(text)) == text
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    longer = [*history, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    short_ids = tok.apply_chat_template(history, add_generation_prompt=False)
    long_ids = tok.apply_chat_template(longer)
    assert long_ids[: len(short_ids)] == short_ids


async def test_long_prefill_threshold_lets_decodes_share_steps(make_engine: Factory) -> None:
    engine, published = make_engine(
        num_blocks=128, max_num_batched_tokens=512, long_prefill_token_threshold=128
    )
    talker = engine.add_request([1, 2, 3], max_tokens=40, ignore_eos=True, reply=REPLY)
    await talker.outputs.get()  # decoding
    long = engine.add_request(list(range(100, 1100)), max_tokens=1, reply=REPLY)
    await asyncio.gather(drain(talker), drain(long))
    chunks = [
        len(e.block_hashes)
        for e in published
        if isinstance(e, BlockStored) and e.token_ids[0] >= 100  # the long prompt's blocks
    ]
    # 1,000 tokens in 128-token chunks: 4 full blocks cached per step (the last: 3)
    assert chunks == [4, 4, 4, 4, 4, 4, 4, 3]
    assert len(talker.output_ids) == 40


async def _admission_order(engine: SimEngine, priorities: Sequence[int]) -> list[int]:
    """Indexes of the requests in the order they ran (one sequence at a time)."""
    order: list[int] = []

    async def run(k: int, req: SimRequest) -> None:
        await drain(req)
        order.append(k)

    reqs = [
        engine.add_request([100 + k] * 8, max_tokens=2, reply=REPLY, priority=p)
        for k, p in enumerate(priorities)
    ]
    await asyncio.gather(*(run(k, r) for k, r in enumerate(reqs)))
    return order


async def test_priority_policy_admits_by_priority_then_arrival(make_engine: Factory) -> None:
    fcfs, _ = make_engine(num_blocks=64, block_size=4, max_num_seqs=1)
    prio, _ = make_engine(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    priorities = [0, 5, 1, -2, 1]
    assert await _admission_order(fcfs, priorities) == [0, 1, 2, 3, 4]  # FCFS ignores it
    assert await _admission_order(prio, priorities) == [3, 0, 2, 4, 1]


async def test_priority_policy_preempts_the_lowest_priority_running_request(
    make_engine: Factory,
) -> None:
    # 4 usable blocks of 4 tokens; each request grows to 4 blocks, so one must give way. Steps
    # take 5 ms, so ``late`` arrives while ``early`` is running.
    stepping = Profile("stepping", 0.0, 0.0, 0.0, 0.0, 0.0, 0.005, 1)
    for policy, victim in (("fcfs", "late"), ("priority", "early")):
        engine, _ = make_engine(stepping, num_blocks=5, block_size=4, scheduling_policy=policy)
        early = engine.add_request(
            [10, 11, 12], max_tokens=12, ignore_eos=True, reply=REPLY, priority=5
        )
        first = await asyncio.wait_for(early.outputs.get(), 10)
        late = engine.add_request(
            [20, 21, 22], max_tokens=12, ignore_eos=True, reply=REPLY, priority=0
        )
        rest, out_late = await asyncio.gather(drain(early), drain(late))
        assert len([first, *rest]) == len(out_late) == 12
        preempted = {"early": early.num_preemptions, "late": late.num_preemptions}
        spared = "late" if victim == "early" else "early"
        assert preempted[victim] >= 1 and preempted[spared] == 0, (policy, preempted)
        assert engine.pool.num_free == 4


def test_priority_comes_from_the_body_or_vllms_header() -> None:
    assert GenParams.parse({}).priority == 0
    assert GenParams.parse({"priority": -3}).priority == -3
    header = {PRIORITY_HEADER: "7"}
    assert GenParams.parse({"priority": -3}, headers=header).priority == 7  # the header wins
    assert GenParams.parse({"priority": 2}, headers={PRIORITY_HEADER: "x"}).priority == 2
    for bad in ("1", 1.5, True):
        with pytest.raises(web.HTTPBadRequest):
            GenParams.parse({"priority": bad})


async def test_a_request_waiting_for_room_is_counted_once_in_the_prefix_cache_queries(
    make_engine: Factory,
) -> None:
    # 4 usable blocks of 4 tokens: ``big`` holds 3 while it decodes for many steps, ``waiter``
    # needs 2, so it sits at the head of the queue until ``big`` finishes
    stepping = Profile("stepping", 0.0, 0.0, 0.0, 0.0, 0.0, 0.002, 1)
    engine, _ = make_engine(stepping, num_blocks=5, block_size=4)
    big = engine.add_request(list(range(10, 20)), max_tokens=3, ignore_eos=True, reply=REPLY)
    waiter = engine.add_request(list(range(30, 36)), max_tokens=1, reply=REPLY)
    await asyncio.gather(drain(big), drain(waiter))
    assert engine.kv.stats.queries == 10 + 6
