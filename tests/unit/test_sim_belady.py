"""Belady eviction in the simulated pool (``loadgen/sim/belady.py``) against hand-made futures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loadgen.sim.belady import BeladyFreeQueue, BeladyOracle, oracle_document
from loadgen.sim.block_pool import BlockPool
from loadgen.sim.engine import EngineConfig, Finished, SimEngine, SimRequest
from loadgen.sim.free_queue import Block
from loadgen.sim.kv_manager import BlockHashCache, KVCacheManager, Sequence
from loadgen.sim.profiles import INSTANT
from loadgen.sim.server import SimConfig, config_argv
from loadgen.sim_cli import config_from_args
from proxy.cli import build_parser

BS = 4
P = list(range(100, 112))  # three full blocks each, nothing shared
Q = list(range(200, 212))
R = list(range(300, 312))


def hashes(tokens: list[int]) -> list[bytes]:
    seq = Sequence("-", list(tokens))
    BlockHashCache(BS, "0").update(seq)
    return seq.block_hashes


def oracle_for(*uses: tuple[float, list[int]]) -> BeladyOracle:
    doc = json.loads(json.dumps(oracle_document(((t, hashes(p)) for t, p in uses), BS, "0")))
    return BeladyOracle.from_document(doc, BS, "0")  # through JSON, as the engine reads it


def play(kv: KVCacheManager, *prompts: list[int]) -> list[int]:
    """Admit and finish each prompt in turn; the cached tokens of each."""
    cached = []
    for i, tokens in enumerate(prompts):
        seq = Sequence(f"r{i}", list(tokens))
        hits = kv.get_computed_blocks(seq)
        assert kv.allocate_slots(seq, len(tokens) - len(hits) * BS, len(hits) * BS, hits)
        kv.record_lookup(seq, hits)
        kv.free(seq)
        cached.append(len(hits) * BS)
    return cached


def test_the_block_used_soonest_survives_where_lru_loses_it() -> None:
    # seven usable blocks: P and Q fit, R must evict two of their six. P comes back, Q never.
    uses = ((0.0, P), (1.0, Q), (2.0, R), (3.0, P))
    lru = KVCacheManager(BlockPool(8, BS), BlockHashCache(BS, "0"))
    assert play(lru, P, Q, R, P) == [0, 0, 0, 4]  # LRU took P's tail: one block left
    pool = BlockPool(8, BS, oracle=oracle_for(*uses))
    belady = KVCacheManager(pool, BlockHashCache(BS, "0"))
    assert play(belady, P, Q, R, P) == [0, 0, 0, 8]  # Q went; P's hit is capped at len - 1
    p, q, r = hashes(P), hashes(Q), hashes(R)
    # R took an empty block and Q's two deepest; P's recomputed last block took R's deepest
    # (P's own was still wanted at 3.0 when it was chosen) and duplicates P's third block
    assert pool.cached_hashes() == {*p, q[0], r[0], r[1]}
    # nobody comes back now: deepest first, then in the order they were freed
    order = [pool.blocks[i].block_hash for i in pool.eviction_order()]
    assert order == [p[2], p[2], r[1], p[1], q[0], r[0], p[0]]


@pytest.mark.parametrize(
    ("q_again", "expected"),
    [
        (False, {"lru": 4, "dead-first": 8, "belady": 8}),  # Q is dead once it ran
        (True, {"lru": 4, "dead-first": 4, "belady": 8}),  # Q comes back, after P
    ],
)
def test_dead_first_drops_only_what_is_never_used_again(
    q_again: bool, expected: dict[str, int]
) -> None:
    """P, Q, R fill and overflow the pool, then P comes back: what P still hits."""
    uses = [(0.0, P), (1.0, Q), (2.0, R), (3.0, P)] + ([(4.0, Q)] if q_again else [])
    got = {"lru": play(KVCacheManager(BlockPool(8, BS), BlockHashCache(BS, "0")), P, Q, R, P)[3]}
    for rule in ("dead-first", "belady"):
        pool = BlockPool(8, BS, oracle=oracle_for(*uses), evict_rule=rule)  # type: ignore[arg-type]
        got[rule] = play(KVCacheManager(pool, BlockHashCache(BS, "0")), P, Q, R, P)[3]
    assert got == expected


def test_dead_first_keeps_lru_order_among_the_living() -> None:
    a, b, c = (Block(i, block_hash=h) for i, h in ((1, b"a"), (2, b"b"), (3, b"c")))
    oracle = BeladyOracle({b"a": [9.0], b"b": [1.0], b"c": [5.0]}, {b"a": 0, b"b": 0, b"c": 0})
    queue = BeladyFreeQueue([a, b, c], oracle, "dead-first")
    assert [blk.block_id for blk in queue] == [1, 2, 3]  # freed in that order: LRU
    oracle.advance(b"b")  # b's only use was admitted elsewhere: b is dead now...
    queue.refresh(b)
    assert [blk.block_id for blk in queue] == [2, 1, 3]  # ...and goes first
    oracle.advance(b"a")
    queue.refresh(a)  # a dead too: the dead go deepest first, then in the order freed
    assert [queue.popleft().block_id for _ in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown eviction rule"):
        BeladyFreeQueue([], oracle, "mru")  # type: ignore[arg-type]


def test_a_use_that_misses_still_moves_the_blocks_next_use() -> None:
    a, b = Block(1, block_hash=b"a"), Block(2, block_hash=b"b")
    oracle = BeladyOracle({b"a": [1.0, 10.0], b"b": [5.0]}, {b"a": 0, b"b": 0})
    queue = BeladyFreeQueue([a, b], oracle)
    assert [blk.block_id for blk in queue] == [2, 1]  # b (next at 5) before a (next at 1)
    oracle.advance(b"a")  # a request used a's hash without hitting this block
    queue.refresh(a)
    assert [blk.block_id for blk in queue] == [1, 2]  # a now next at 10
    queue.remove(a)  # a hit took it back: its stale entries are skipped
    assert queue.num_free == 1
    assert queue.popleft() is b
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_empty_blocks_are_handed_out_before_any_cached_one() -> None:
    empty, cached = Block(1), Block(2, block_hash=b"x")
    queue = BeladyFreeQueue([cached], BeladyOracle({}, {}))
    queue.prepend_n([empty])
    assert [queue.popleft(), queue.popleft()] == [empty, cached]


def test_a_reset_makes_every_block_empty() -> None:
    pool = BlockPool(8, BS, oracle=oracle_for((0.0, P), (1.0, P)))
    kv = KVCacheManager(pool, BlockHashCache(BS, "0"))
    play(kv, P)
    assert pool.reset_prefix_cache()
    assert pool.num_free == 7 and not pool.cached_hashes()
    assert play(kv, P) == [0]


def test_an_oracle_of_other_blocks_is_refused() -> None:
    doc = oracle_document([(0.0, hashes(P))], BS, "0")
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        BeladyOracle.from_document(doc, 16, "0")
    with pytest.raises(ValueError, match="seed"):
        BeladyOracle.from_document(doc, BS, "1")


async def _cached(engine: SimEngine, prompt: list[int]) -> int:
    req: SimRequest = engine.add_request(prompt, max_tokens=1, reply=[7])
    while not isinstance(await asyncio.wait_for(req.outputs.get(), 10), Finished):
        pass
    return req.num_cached_tokens


async def test_the_engine_evicts_by_its_oracle_file(tmp_path: Path) -> None:
    path = tmp_path / "oracle.json"
    uses = [(0.0, hashes(P)), (1.0, hashes(Q)), (2.0, hashes(R)), (3.0, hashes(P))]
    path.write_text(json.dumps(oracle_document(uses, BS, "0")))
    got = {}
    for name, oracle in (("lru", ""), ("belady", str(path))):
        engine = SimEngine(EngineConfig(num_blocks=8, block_size=BS, evict_oracle=oracle), INSTANT)
        engine.start()
        try:
            got[name] = [await _cached(engine, p) for p in (P, Q, R, P)]
        finally:
            await engine.stop()
    # the reply's token fills no block, so each request holds its prompt's three blocks
    assert got == {"lru": [0, 0, 0, 4], "belady": [0, 0, 0, 8]}


def test_every_simulator_setting_survives_the_trip_to_its_process() -> None:
    config = SimConfig(
        port=8123, num_blocks=99, block_size=16, cpu_blocks=64, cpu_l2_blocks=32,
        scheduling_policy="priority", evict_oracle="/tmp/oracle.json", evict_rule="dead-first",
        replay_port=None,
    )  # fmt: skip
    args = build_parser().parse_args(["sim", *config_argv(config)])
    assert config_from_args(args) == config
