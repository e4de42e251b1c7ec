"""The simulator's block pool against hand-computed vLLM V1 eviction orders (pure, no I/O).

Block size 4 keeps the tables readable. A pool of N blocks has usable ids 1..N-1 (block 0 is
vLLM's null block). Comments give the free queue head (next evicted) first.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adapters.block_hash import BlockHasher, event_id, sha256_cbor
from loadgen.sim.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVEvent
from loadgen.sim.kv_manager import BlockHashCache, KVCacheManager, Sequence

BS = 4
HASHER = BlockHasher(block_size=BS, hash_seed="0")


def ids(tokens: list[int], salt: str | None = None) -> list[int]:
    """Expected ids: adapters' BlockHasher when unsalted; the vLLM 0.32 salted form by hand."""
    if salt is None:
        return HASHER.block_ids(tokens)
    parent = sha256_cbor("0")
    out = []
    for i in range(len(tokens) // BS):
        extra = (("cache_salt", salt),) if i == 0 else None
        parent = sha256_cbor((parent, tuple(tokens[i * BS : (i + 1) * BS]), extra))
        out.append(event_id(parent))
    return out


def make(num_blocks: int) -> tuple[KVCacheManager, list[KVEvent]]:
    events: list[KVEvent] = []
    pool = BlockPool(num_blocks, BS, events)
    return KVCacheManager(pool, BlockHashCache(BS, "0")), events


def admit(kv: KVCacheManager, name: str, tokens: list[int], salt: str | None = None) -> int:
    """Schedule a whole prompt as vLLM does for a new request; returns cached tokens."""
    seq = Sequence(name, list(tokens), salt)
    hits = kv.get_computed_blocks(seq)
    cached = len(hits) * BS
    assert kv.allocate_slots(seq, len(tokens) - cached, cached, hits)
    kv.record_lookup(seq, hits)
    seq.num_computed_tokens = len(tokens)
    SEQS[name] = seq
    return cached


SEQS: dict[str, Sequence] = {}


def free(kv: KVCacheManager, name: str) -> None:
    kv.free(SEQS.pop(name))


A = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
B = [*A[:8], 7, 7, 7, 7]  # shares A's 2 full blocks, 3 full blocks
C = list(range(500, 528))  # 7 full blocks, nothing shared


@dataclass(frozen=True)
class Case:
    name: str
    steps: list[tuple[str, str, list[int]]]  # (op, request, tokens)
    cached: list[int]  # cached tokens per "admit", in order
    order: list[int]  # free-queue ids at the end, next-evicted first


CASES = [
    Case("fresh pool pops from the head", [("admit", "a", A)], [0], [4, 5, 6, 7]),
    Case(
        "a finished request goes to the tail in reverse",
        [("admit", "a", A), ("free", "a", [])],
        [0],
        [3, 4, 5, 6, 7, 2, 1],  # partial block 3 (no hash) to the head; 2, 1 to the tail
    ),
    Case(
        "a hit pulls blocks out of the queue; they return at the tail",
        [("admit", "a", A), ("free", "a", []), ("admit", "b", B), ("free", "b", [])],
        [0, 8],
        [4, 5, 6, 7, 3, 2, 1],  # b popped 3 (head) and filled it: now hashed, so tail
    ),
    Case(
        "a running request's blocks are not in the queue",
        [("admit", "a", A), ("admit", "b", B)],
        [0, 8],
        [5, 6, 7],
    ),
    Case(
        "a full hit still recomputes the last token: 8 cached of 8 is reported as 4",
        [("admit", "x", A[:8]), ("free", "x", []), ("admit", "y", A[:8])],
        [0, 4],
        [4, 5, 6, 7, 2],  # y re-took block 1 and popped 3; 2 still holds a duplicate hash
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_eviction_order(case: Case) -> None:
    kv, _ = make(8)
    SEQS.clear()
    cached = []
    for op, name, tokens in case.steps:
        if op == "admit":
            cached.append(admit(kv, name, tokens))
        else:
            free(kv, name)
    assert cached == case.cached
    assert kv.pool.eviction_order() == case.order


def test_eviction_from_head_emits_block_removed_in_pop_order() -> None:
    kv, events = make(8)
    SEQS.clear()
    admit(kv, "a", A)
    free(kv, "a")  # queue: 3 4 5 6 7 2 1 (3, the partial block, went to the head)
    admit(kv, "b", B)  # hits 1,2; pops 3
    free(kv, "b")  # queue: 4 5 6 7 3 2 1  (3 holds B's 3rd block)
    events.clear()
    assert admit(kv, "c", C) == 0  # pops all 7: 4 5 6 7 3 2 1
    a_ids, b_ids = ids(A), ids(B)
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [b_ids[2], a_ids[1], a_ids[0]]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 1
    assert stored[0].block_hashes == ids(C)
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == C
    assert kv.pool.num_free == 0
    assert kv.pool.usage == 1.0


def test_block_stored_chains_from_the_hit_prefix() -> None:
    kv, events = make(8)
    SEQS.clear()
    admit(kv, "a", A)
    free(kv, "a")
    events.clear()
    admit(kv, "b", B)
    (stored,) = events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [ids(B)[2]]
    assert stored.parent_block_hash == ids(A)[1]
    assert stored.token_ids == B[8:12]


def test_allocation_refused_when_hits_plus_new_blocks_exceed_free() -> None:
    kv, _ = make(4)  # 3 usable blocks
    SEQS.clear()
    admit(kv, "a", A)  # holds 1,2,3
    seq = Sequence("b", list(B))
    assert kv.get_computed_blocks(seq)  # A's blocks are cached (and held)
    assert not kv.allocate_slots(seq, 4, 8, kv.get_computed_blocks(seq))
    free(kv, "a")
    hits = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, 4, 8, hits)


def test_cache_salt_isolates_the_whole_chain() -> None:
    kv, events = make(8)
    SEQS.clear()
    admit(kv, "a", A, salt="tenant-1")
    free(kv, "a")
    assert admit(kv, "b", A) == 0  # same tokens, no salt: nothing shared
    free(kv, "b")
    assert admit(kv, "c", A, salt="tenant-1") == 8
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == ids(A, "tenant-1")
    assert stored[0].extra_keys == [["tenant-1"], None]
    assert stored[1].block_hashes == ids(A)
    assert stored[1].extra_keys == [None, None]
    assert ids(A, "tenant-1")[0] != ids(A)[0]


@pytest.mark.parametrize("salt", [None, "s"])
def test_incremental_hashes_match_whole_sequence_hashing(salt: str | None) -> None:
    cache = BlockHashCache(BS, "0")
    seq = Sequence("r", A[:5], salt)
    cache.update(seq)
    for t in A[5:]:
        seq.token_ids.append(t)
        cache.update(seq)
    assert [event_id(h) for h in seq.block_hashes] == ids(A, salt)


def test_reset_refused_while_blocks_are_held_then_clears_all() -> None:
    kv, events = make(8)
    SEQS.clear()
    admit(kv, "a", A)
    assert not kv.pool.reset_prefix_cache()
    free(kv, "a")
    assert kv.pool.reset_prefix_cache()
    assert isinstance(events[-1], AllBlocksCleared)
    assert kv.pool.cached_hashes() == set()
    assert admit(kv, "b", A) == 0


def test_stats_count_queries_and_hits_in_tokens() -> None:
    kv, _ = make(8)
    SEQS.clear()
    admit(kv, "a", A)
    free(kv, "a")
    admit(kv, "b", B)
    assert (kv.stats.queries, kv.stats.hits) == (len(A) + len(B), 8)


def test_duplicate_blocks_are_not_deduplicated() -> None:
    kv, events = make(8)
    SEQS.clear()
    admit(kv, "a", A[:8])
    admit(kv, "b", A[:8])  # 'a' still running: hit on block 1 only (cap 7 tokens -> 1 block)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [s.block_hashes for s in stored] == [ids(A[:8]), [ids(A[:8])[1]]]
    free(kv, "a")
    free(kv, "b")
    # queue: 4 5 6 7 2 3 1 -- blocks 2 and 3 both hold A's 2nd hash; each pop emits its own
    assert kv.pool.eviction_order() == [4, 5, 6, 7, 2, 3, 1]
    events.clear()
    admit(kv, "c", C[:24])  # pops 6 blocks: 4 5 6 7 2 3
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [ids(A[:8])[1], ids(A[:8])[1]]
    assert kv.pool.eviction_order() == [1]


def test_a_waiting_requests_remembered_lookup_matches_a_fresh_one() -> None:
    """The head of the queue looks its prefix up at every step; the answer it remembers is
    extended while nothing cached is removed and redone after a removal, and is always the
    one a fresh look-up gives (random prompts over shared prefixes, a pool small enough to
    evict, requests coming and going)."""
    import random

    rng = random.Random(7)
    kv, _ = make(24)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    waiting = Sequence("w", [*stems[0], *(rng.randrange(50) for _ in range(20))])
    live: list[str] = []
    remembered = 0
    for step in range(300):
        if live and (rng.random() < 0.5 or len(live) > 3):
            free(kv, live.pop(rng.randrange(len(live))))
        else:
            stem = stems[rng.randrange(3)]
            tokens = [*stem[: rng.randrange(4, 13)], *(rng.randrange(50) for _ in range(6))]
            name = f"r{step}"
            seq = Sequence(name, tokens)
            hits = kv.get_computed_blocks(seq)
            if kv.allocate_slots(seq, len(tokens) - len(hits) * BS, len(hits) * BS, hits):
                kv.record_lookup(seq, hits)
                seq.num_computed_tokens = len(tokens)
                SEQS[name] = seq
                live.append(name)
            else:
                kv.free(seq)
        before = waiting.last_hits
        remembered += before is not None and before[0] == kv.pool.removals
        got = kv.get_computed_blocks(waiting)
        fresh = kv.pool.find_longest_cache_hit(waiting.block_hashes, waiting.num_tokens - 1)
        assert got == fresh, step
    assert remembered > 50  # the memo was used, not only recomputed
    for name in live:
        free(kv, name)
