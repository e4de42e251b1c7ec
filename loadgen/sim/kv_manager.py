"""vLLM V1's ``KVCacheManager`` (full attention, one KV group) over :class:`BlockPool`.

Follows ``vllm/v1/core/kv_cache_manager.py`` and ``single_type_kv_cache_manager.py``:

- ``get_computed_blocks`` looks up at most ``num_tokens - 1`` tokens: the last token is always
  recomputed to get logits, so a fully cached prompt of ``k * block_size`` tokens reports
  ``(k - 1) * block_size`` cached tokens.
- ``allocate_slots`` refuses (returns False) when the new blocks plus the evictable hit blocks
  exceed the free count; otherwise it touches the hits, pops new blocks from the head and
  caches every block that the scheduled tokens fill (one ``BlockStored`` per call).
- ``free`` releases a request's blocks in reverse, so its tail is evicted before its head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adapters.block_hash import event_id, sha256_cbor
from loadgen.sim.block_pool import BlockPool
from loadgen.sim.free_queue import Block


@dataclass(eq=False, slots=True)
class Sequence:
    """The cache-relevant state of one request (vLLM ``Request``)."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    # its last prefix look-up and the pool's removal count then: still exact until a cached
    # block is removed, so a request waiting at the head of the queue only extends it
    last_hits: tuple[int, list[Block]] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class BlockHashCache:
    """Incremental chained hashing: each request hashes only its new full blocks, once.

    vLLM 0.32 tags each extra key with its source: a salted chain's first block hashes
    ``(parent, tokens, (("cache_salt", salt),))`` (``generate_block_hash_extra_keys``).
    """

    def __init__(self, block_size: int, hash_seed: str) -> None:
        self.block_size = block_size
        self.none_hash = sha256_cbor(hash_seed)

    def update(self, seq: Sequence) -> None:
        bs, tokens, hashes = self.block_size, seq.token_ids, seq.block_hashes
        parent = hashes[-1] if hashes else self.none_hash
        for i in range(len(hashes), len(tokens) // bs):
            extra: tuple[Any, ...] | None = None
            if seq.cache_salt and i == 0:
                extra = (("cache_salt", seq.cache_salt),)
            parent = sha256_cbor((parent, tuple(tokens[i * bs : (i + 1) * bs]), extra))
            hashes.append(parent)


def block_ids(
    token_ids: list[int],
    *,
    block_size: int = 32,
    hash_seed: str = "0",
    cache_salt: str | None = None,
) -> list[int]:
    """KV-event ids of a token sequence's full blocks, exactly as vLLM 0.32 hashes them."""
    seq = Sequence("-", token_ids, cache_salt)
    BlockHashCache(block_size, hash_seed).update(seq)
    return [event_id(h) for h in seq.block_hashes]


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters behind ``vllm:prefix_cache_queries`` / ``_hits`` (tokens)."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class KVCacheManager:
    """Per-request block tables over one pool."""

    def __init__(self, pool: BlockPool, hasher: BlockHashCache) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = pool.block_size
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """Longest cached prefix (whole blocks), capped at ``num_tokens - 1`` tokens."""
        self.hasher.update(seq)
        known: list[Block] = []
        if seq.last_hits is not None and seq.last_hits[0] == self.pool.removals:
            known = seq.last_hits[1]
        hits = self.pool.find_longest_cache_hit(seq.block_hashes, seq.num_tokens - 1, known)
        seq.last_hits = (self.pool.removals, hits)
        return list(hits)

    def record_lookup(self, seq: Sequence, hits: list[Block], *, preempted: bool = False) -> None:
        """Count an admitted request's lookup. vLLM 0.32 records at admission, so a request
        that waits at the head of the queue for many steps counts once."""
        hit_tokens = len(hits) * self.block_size
        if preempted:
            self.stats.preempted_queries += seq.num_tokens
            self.stats.preempted_hits += hit_tokens
        else:
            self.stats.queries += seq.num_tokens
            self.stats.hits += hit_tokens
            self.pool.record_use(seq.block_hashes)

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[Block] | None = None,
        *,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        """Give ``seq`` slots for its computed + new tokens; False when the pool is short.

        ``full_sequence_must_fit`` (vLLM 0.32's ``scheduler_reserve_full_isl``, on for waiting
        requests) admits a request only if its whole sequence fits, not just this chunk.
        """
        hits = new_computed_blocks or []
        blocks = self.req_blocks.get(seq.request_id)
        held = len(blocks) if blocks is not None else 0
        num_computed = seq.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        required = -(-total // self.block_size)
        num_new_blocks = required - len(hits) - held
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if full_sequence_must_fit:
            full_blocks = -(-seq.num_tokens // self.block_size) - len(hits) - held
            if max(full_blocks, 0) + evictable_hits > self.pool.num_free:
                return False
        if max(num_new_blocks, 0) + evictable_hits > self.pool.num_free:
            return False
        if blocks is None:
            blocks = self.req_blocks[seq.request_id] = []
            self.num_cached_blocks[seq.request_id] = len(hits)
        self.pool.touch(hits)
        blocks.extend(hits)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        self._cache_blocks(seq, blocks, min(total, seq.num_tokens))
        return True

    def _cache_blocks(self, seq: Sequence, blocks: list[Block], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_blocks[seq.request_id]
        if num_full <= num_cached:
            return
        self.hasher.update(seq)
        self.pool.cache_full_blocks(
            blocks, seq.block_hashes, seq.token_ids, num_cached, num_full, seq.cache_salt
        )
        self.num_cached_blocks[seq.request_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Release the request's blocks, tail first (vLLM frees in reverse order)."""
        blocks = self.req_blocks.pop(seq.request_id, [])
        self.num_cached_blocks.pop(seq.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def num_blocks_held(self, seq: Sequence) -> int:
        return len(self.req_blocks.get(seq.request_id, ()))
