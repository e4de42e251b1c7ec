"""Belady's eviction for the simulated pool: vanilla vLLM that knows every block's future.

``kvkeeper sim --evict-oracle FILE`` keeps vLLM's scheduler and pool and changes one thing:
when a new block is needed and no free block is empty, the pool evicts the free cached block
whose next use is farthest away (never used again first; among equals the deepest in its
chain, which keeps cached chains prefix-closed) instead of the least recently freed one. This
is what "eviction alone" can do on a real engine, with perfect knowledge, so ``kvkeeper bench
compare``'s ``engine-belady`` target measures the TTFT of the best eviction order beside
what kvkeeper realizes with what eviction cannot (an offload tier, prefetch, placement).

The oracle (:func:`oracle_document`) lists, per block hash, the times the workload's requests
use it: a run's realized send times, or the planned timeline. The engine counts the uses it
has admitted (:meth:`BeladyOracle.advance`), so a block admitted ``k`` times next comes at its
``k``-th listed time. Counting uses instead of reading the clock keeps the oracle right when
the engine runs faster or slower than the run it was taken from: only the order in which
sessions reach a shared block can drift, not which use comes next.

``--evict-rule dead-first`` uses the same oracle for less: blocks nobody will use again go first
(deepest first), everything else in vLLM's LRU order. That is the engine an exact "this context
is finished" hint would give (the RFC's evict on a finished branch, per block), and so separates
what Belady wins by dropping dead context from what it wins by ordering the live.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from loadgen.sim.free_queue import Block, FreeBlockQueue

EvictRule = Literal["belady", "dead-first"]
EVICT_RULES: tuple[EvictRule, ...] = ("belady", "dead-first")
NEVER = math.inf
_UNKNOWN_DEPTH = 1 << 30  # blocks the oracle does not list (generated tokens): deepest


def oracle_document(
    uses: Iterable[tuple[float, Sequence[bytes]]], block_size: int, hash_seed: str
) -> dict[str, Any]:
    """The oracle file's content from ``(time, prompt block hashes)`` per request."""
    times: dict[bytes, list[float]] = {}
    depth: dict[bytes, int] = {}
    for t, hashes in uses:
        for i, h in enumerate(hashes):
            times.setdefault(h, []).append(t)
            depth.setdefault(h, i)
    return {
        "block_size": block_size,
        "hash_seed": hash_seed,
        "blocks": [[h.hex(), depth[h], sorted(ts)] for h, ts in times.items()],
    }


class BeladyOracle:
    """Future uses per block hash, and how many of them the engine has admitted."""

    def __init__(self, times: dict[bytes, list[float]], depth: dict[bytes, int]) -> None:
        self._times = times
        self._depth = depth
        self._used: dict[bytes, int] = {}
        self.admitted = 0  # prompt blocks of admitted requests
        self.unknown = 0  # ... that the oracle does not list (should stay 0: a check)

    @classmethod
    def from_document(cls, doc: dict[str, Any], block_size: int, hash_seed: str) -> BeladyOracle:
        if doc.get("block_size") != block_size or str(doc.get("hash_seed")) != hash_seed:
            raise ValueError(
                f"oracle hashes blocks of {doc.get('block_size')} tokens with seed "
                f"{doc.get('hash_seed')!r}; the engine uses {block_size} and {hash_seed!r}"
            )
        times: dict[bytes, list[float]] = {}
        depth: dict[bytes, int] = {}
        for hex_hash, d, ts in doc["blocks"]:
            h = bytes.fromhex(hex_hash)
            times[h] = [float(t) for t in ts]
            depth[h] = int(d)
        return cls(times, depth)

    @classmethod
    def load(cls, path: str | Path, block_size: int, hash_seed: str) -> BeladyOracle:
        doc = json.loads(Path(path).read_text())
        return cls.from_document(doc, block_size, hash_seed)

    def __len__(self) -> int:
        return len(self._times)

    def next_use(self, block_hash: bytes) -> float:
        ts = self._times.get(block_hash)
        k = self._used.get(block_hash, 0)
        return ts[k] if ts is not None and k < len(ts) else NEVER

    def depth(self, block_hash: bytes) -> int:
        return self._depth.get(block_hash, _UNKNOWN_DEPTH)

    def advance(self, block_hash: bytes) -> None:
        """One more admitted request uses ``block_hash``."""
        self._used[block_hash] = self._used.get(block_hash, 0) + 1
        self.admitted += 1
        if block_hash not in self._times:
            self.unknown += 1


class BeladyFreeQueue:
    """:class:`FreeBlockQueue`'s interface, evicting by the oracle.

    Empty (hash-less) free blocks are handed out first, in vLLM's order; cached ones wait in a
    heap: ``belady``, the farthest next use first (then the deepest); ``dead-first``, the
    blocks never used again first (the deepest first), then the least recently freed. Entries
    are invalidated lazily: a block taken back by a hit, or re-keyed by :meth:`refresh`, leaves
    a stale entry that ``popleft`` skips."""

    def __init__(
        self, blocks: Sequence[Block], oracle: BeladyOracle, rule: EvictRule = "belady"
    ) -> None:
        if rule not in EVICT_RULES:
            raise ValueError(f"unknown eviction rule {rule!r}; choose from {EVICT_RULES}")
        self.oracle = oracle
        self.rule = rule
        self._empty = FreeBlockQueue(())
        # (key, depth key, order freed, stamp, block): min-heap, the next to evict on top
        self._heap: list[tuple[float, int, int, int, Block]] = []
        self._cached: dict[int, int] = {}  # block id -> stamp of its live heap entry
        self._freed_at: dict[int, int] = {}  # block id -> when it was freed (LRU order)
        self._stamps = itertools.count()
        for block in blocks:
            self.append(block)

    @property
    def num_free(self) -> int:
        return self._empty.num_free + len(self._cached)

    def popleft(self) -> Block:
        if self._empty.num_free:
            return self._empty.popleft()
        while self._heap:
            *_, stamp, block = heapq.heappop(self._heap)
            if self._cached.get(block.block_id) == stamp:
                del self._cached[block.block_id], self._freed_at[block.block_id]
                return block
        raise ValueError("no free blocks")

    def remove(self, block: Block) -> None:
        if self._cached.pop(block.block_id, None) is None:
            self._empty.remove(block)
        else:
            del self._freed_at[block.block_id]

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        empty = [b for b in blocks if b.block_hash is None]
        self._empty.prepend_n(empty)
        for block in blocks:
            if block.block_hash is not None:
                self._push(block, freed=True)

    def append(self, block: Block) -> None:
        if block.block_hash is None:
            self._empty.append(block)
        else:
            self._push(block, freed=True)

    def refresh(self, block: Block) -> None:
        """Re-key a free cached block whose next use moved (a request used its hash); it keeps
        its place in LRU order."""
        if block.block_id in self._cached:
            self._push(block, freed=False)

    def forget_hashes(self) -> None:
        """Every block lost its hash (a prefix-cache reset): all are empty now."""
        blocks = list(self)
        self._heap.clear()
        self._cached.clear()
        self._freed_at.clear()
        self._empty = FreeBlockQueue(blocks)

    def _live(self, entry: tuple[float, int, int, int, Block]) -> bool:
        return self._cached.get(entry[4].block_id) == entry[3]

    def _push(self, block: Block, *, freed: bool) -> None:
        assert block.block_hash is not None
        stamp = next(self._stamps)
        self._cached[block.block_id] = stamp
        if freed:
            self._freed_at[block.block_id] = stamp
        order = self._freed_at[block.block_id]
        nxt = self.oracle.next_use(block.block_hash)
        depth = -self.oracle.depth(block.block_hash)
        if self.rule == "belady":
            entry = (-nxt, depth, stamp, stamp, block)
        elif nxt == NEVER:  # dead-first: dead blocks, deepest first...
            entry = (-NEVER, depth, order, stamp, block)
        else:  # ... then everything else least recently freed first, as vLLM's LRU
            entry = (0.0, 0, order, stamp, block)
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._cached) + 64:  # drop the stale entries
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Block]:
        """Free blocks, next to be evicted first."""
        yield from self._empty
        for entry in sorted(e for e in self._heap if self._live(e)):
            yield entry[4]
