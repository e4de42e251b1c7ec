"""vLLM V1's prefix-cache block pool, reproduced for the simulator.

Mirrors ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.FreeKVCacheBlockQueue``:

- ``num_blocks`` blocks; block 0 is popped at start as the *null block* and never handed out,
  so ``--num-blocks 200`` leaves 199 usable blocks, exactly like ``--num-gpu-blocks-override 200``.
- The free queue is a doubly linked list: allocation pops from the head and a prefix hit
  removes a cached block from the middle (O(1)). Freeing (vLLM 0.32 ``free_blocks``) appends
  blocks that hold a hash to the tail (LRU) and PREPENDS blocks without one (a request's
  partial tail block) to the head, in the order given, for LIFO reuse.
- A freed block keeps its hash (it stays an eviction candidate) until it is popped again;
  popping a cached block evicts it and emits ``BlockRemoved``.
- Identical blocks are not de-duplicated: two requests computing the same block at once both
  cache it; lookups return the first one cached.
- Given a :class:`~loadgen.sim.belady.BeladyOracle`, cached free blocks are evicted by Belady's
  rule instead (farthest next use first; ``loadgen/sim/belady.py``), the rest unchanged.

Pure: no I/O, no asyncio. Events are appended to a caller-supplied list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from adapters.block_hash import event_id
from loadgen.sim.belady import BeladyFreeQueue, BeladyOracle, EvictRule
from loadgen.sim.free_queue import Block, FreeBlockQueue

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """New full blocks entered a tier (vLLM ``BlockStored``).

    ``extra_keys`` has one entry per block, untagged as vLLM publishes them: ``[salt]`` for a
    salted chain's first block, else None.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    extra_keys: list[list[str] | None] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left a tier (vLLM ``BlockRemoved``)."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset (vLLM ``AllBlocksCleared``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Blocks, the free queue and the hash -> cached block map."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: list[KVEvent] | None = None,
        oracle: BeladyOracle | None = None,
        evict_rule: EvictRule = "belady",
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: FreeBlockQueue | BeladyFreeQueue
        self._belady: BeladyFreeQueue | None = None
        if oracle is None:
            self.free_queue = FreeBlockQueue(self.blocks)
        else:
            self.free_queue = self._belady = BeladyFreeQueue(self.blocks, oracle, evict_rule)
        self.null_block = self.free_queue.popleft()
        self._cached: dict[bytes, dict[int, Block]] = {}
        self.removals = 0  # cached entries removed so far: earlier look-ups hold until it moves
        self.events: list[KVEvent] = events if events is not None else []

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def oracle(self) -> BeladyOracle | None:
        """The future the pool evicts by (None: LRU)."""
        return None if self._belady is None else self._belady.oracle

    @property
    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: share of usable blocks held by requests."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        entries = self._cached.get(block_hash)
        return next(iter(entries.values())) if entries else None

    def find_longest_cache_hit(
        self, hashes: Sequence[bytes], max_length: int, known: Sequence[Block] = ()
    ) -> list[Block]:
        """Cached blocks for the longest hit prefix, at most ``max_length`` tokens; ``known``:
        an earlier answer for the same hashes with no removal since (``removals``), which
        stays a hit, so the search goes on from its end."""
        limit = max_length // self.block_size
        hits = list(known[:limit])
        for block_hash in hashes[len(hits) : limit]:
            block = self.get_cached_block(block_hash)
            if block is None:
                break  # hashes are chained: nothing after a miss can hit
            hits.append(block)
        return hits

    def touch(self, blocks: Iterable[Block]) -> None:
        """A prefix hit: take ref-0 (free, evictable) blocks out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop ``n`` blocks from the head, evicting the cached ones."""
        if n > self.num_free:
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out: list[Block] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._maybe_evict(block)
            block.ref_cnt += 1
            out.append(block)
        return out

    def _maybe_evict(self, block: Block) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        entries = self._cached.get(block_hash)
        if entries is None or entries.pop(block.block_id, None) is None:
            return
        if not entries:
            del self._cached[block_hash]
        self.removals += 1
        self.events.append(BlockRemoved([event_id(block_hash)]))

    def record_use(self, hashes: Iterable[bytes]) -> None:
        """An admitted request uses these blocks (its prompt's): Belady's oracle moves on."""
        if self._belady is None:
            return
        for block_hash in hashes:
            self._belady.oracle.advance(block_hash)
            for block in self._cached.get(block_hash, {}).values():
                if block.ref_cnt == 0:
                    self._belady.refresh(block)

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Release blocks; at ref 0, hashed ones join the tail, unhashed ones the head."""
        reuse_first: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block is not self.null_block:
                if block.block_hash is None:
                    reuse_first.append(block)
                else:
                    self.free_queue.append(block)
        self.free_queue.prepend_n(reuse_first)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        num_cached: int,
        num_full: int,
        cache_salt: str | None = None,
    ) -> None:
        """Register blocks ``[num_cached, num_full)`` of a request and emit one BlockStored."""
        if num_full <= num_cached:
            return
        new_ids: list[int] = []
        for i in range(num_cached, num_full):
            block, block_hash = blocks[i], hashes[i]
            assert block.block_hash is None, "block already cached"
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block.block_id] = block
            new_ids.append(event_id(block_hash))
        parent = event_id(hashes[num_cached - 1]) if num_cached > 0 else None
        bs = self.block_size
        tokens = list(token_ids[num_cached * bs : num_full * bs])
        extra: list[list[str] | None] = [None] * (num_full - num_cached)
        if cache_salt and num_cached == 0:
            extra[0] = [cache_salt]
        self.events.append(BlockStored(new_ids, parent, tokens, bs, extra_keys=extra))

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any block is held by a request."""
        if self.num_free != self.num_blocks - 1:
            return False
        self._cached.clear()
        self.removals += 1
        for block in self.blocks:
            block.block_hash = None
        if self._belady is not None:
            self._belady.forget_hashes()
        self.events.append(AllBlocksCleared())
        return True

    def cached_hashes(self) -> set[bytes]:
        """Every hash currently resident (held or evictable)."""
        return set(self._cached)

    def eviction_order(self) -> list[int]:
        """Free block ids, next-to-be-evicted first (for tests and debugging)."""
        return [b.block_id for b in self.free_queue]
