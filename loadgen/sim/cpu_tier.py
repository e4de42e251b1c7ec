"""An LMCache-like CPU tier: 256-token chunks keyed by token ids, LRU, pins.

Like LMCache in front of vLLM, the tier is written through: when a request's prefill is done,
every full chunk of its prompt is stored (or refreshed to most-recently-used). So blocks that
the device tier later evicts are still here and a new request can load them back instead of
recomputing them. Only full chunks are stored (LMCache observed: an 830-token prompt stored
three 256-token chunks). Pinned chunks are never evicted by LRU; explicit deletes and clears
still remove them (as LMCache's explicit L2 delete does). Pins are counted per chunk key and
exist independently of storage, as on LMCache's coordinator: pinning a prefix protects its
chunks stored later too; each unpin lowers the count by one.

With ``l2_capacity_chunks`` > 0 the tier has two levels, as LMCache's multi-process server
does: L1 (CPU memory, ``capacity_chunks``) is a plain LRU that pins do not protect, and every
chunk stored there is written through to L2 (``l2_capacity_chunks``, e.g. an ``fs`` adapter
with a capacity), whose eviction skips pinned chunks (the coordinator's pins protect L2 eviction
plans only). A lookup that finds a chunk only in L2 loads it back into L1 at once, as the MP
server's prefetch on lookup does; a request admitted at that lookup pays the slower L2 load for
those tokens (:meth:`lookup_sources`), one that waits in the queue finds them in L1 later and
pays the L1 rate (the L2 read overlapped its wait).

Chunk keys chain over chunks (``chunk[i] = h(chunk[i-1], tokens, salt on chunk 0)``), so a key
names a whole prefix, like LMCache's own chunk hashes. Events for this tier carry vLLM's block
hashes of the blocks in each chunk, with ``medium: "CPU"``.

Pure: no I/O. Events go to the shared event list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from adapters.block_hash import event_id, sha256_cbor
from loadgen.sim.block_pool import MEDIUM_CPU, BlockRemoved, BlockStored, KVEvent

CHUNK_TOKENS = 256


@dataclass(slots=True)
class Chunk:
    """One stored chunk: its key, the vLLM block hashes it covers, and pin state."""

    key: str
    cache_salt: str | None
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    access_count: int = 0


class CpuTier:
    """LRU of chunks (oldest first in the OrderedDict)."""

    def __init__(
        self,
        capacity_chunks: int,
        block_size: int,
        hash_seed: str,
        events: list[KVEvent],
        chunk_tokens: int = CHUNK_TOKENS,
        l2_capacity_chunks: int = 0,
    ) -> None:
        if chunk_tokens % block_size:
            raise ValueError("chunk size must be a multiple of the block size")
        self.capacity = capacity_chunks
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.events = events
        self._seed = hash_seed
        self.chunks: OrderedDict[str, Chunk] = OrderedDict()  # L1 (the only level without L2)
        self.l2_capacity = l2_capacity_chunks
        self.l2: OrderedDict[str, Chunk] = OrderedDict()  # empty without L2
        self.pins: dict[str, int] = {}  # chunk key -> pin count

    def chunk_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> list[str]:
        """Keys of every full chunk of ``token_ids``."""
        keys: list[str] = []
        parent: bytes = sha256_cbor(("lmcache", self._seed))
        ct = self.chunk_tokens
        for i in range(len(token_ids) // ct):
            extra = cache_salt if i == 0 else None
            parent = sha256_cbor((parent, tuple(token_ids[i * ct : (i + 1) * ct]), extra))
            keys.append(parent.hex())
        return keys

    def lookup_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, keys: Sequence[str] | None = None
    ) -> int:
        """Leading tokens stored (whole chunks); refreshes those chunks in the LRU. ``keys``:
        :meth:`chunk_keys` of the same tokens, when the caller kept them."""
        return len(self.lookup_sources(token_ids, cache_salt, keys)) * self.chunk_tokens

    def lookup_sources(
        self, token_ids: Sequence[int], cache_salt: str | None, keys: Sequence[str] | None = None
    ) -> list[bool]:
        """Per leading stored chunk, whether it came from L2 (loaded back into L1 now)."""
        out: list[bool] = []
        for key in self.chunk_keys(token_ids, cache_salt) if keys is None else keys:
            chunk = self.chunks.get(key)
            from_l2 = chunk is None
            if chunk is not None:
                self.chunks.move_to_end(key)
            else:
                chunk = self.l2.get(key)
                if chunk is None or not self._make_room():
                    break
                self.chunks[key] = chunk
                self._announce(chunk)
            if key in self.l2:
                self.l2.move_to_end(key)
            chunk.access_count += 1
            out.append(from_l2)
        return out

    def holds(self, key: str) -> bool:
        """Whether any level stores the chunk."""
        return key in self.chunks or key in self.l2

    def store(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        cache_salt: str | None,
        keys: Sequence[str] | None = None,
    ) -> int:
        """Store every full chunk of a computed prefix; returns chunks newly stored."""
        per_chunk = self.chunk_tokens // self.block_size
        new = 0
        if keys is None:
            keys = self.chunk_keys(token_ids, cache_salt)
        for i, key in enumerate(keys):
            known = self.chunks.get(key) or self.l2.get(key)
            if known is None:
                hashes = list(block_hashes[i * per_chunk : (i + 1) * per_chunk])
                parent = block_hashes[i * per_chunk - 1] if i else None
                ct = self.chunk_tokens
                tokens = list(token_ids[i * ct : (i + 1) * ct])
                known = Chunk(key, cache_salt, hashes, parent, tokens)
            if self.l2_capacity > 0:  # written through to L2
                if key in self.l2:
                    self.l2.move_to_end(key)
                elif self._make_room_l2():
                    self.l2[key] = known
            if key in self.chunks:
                self.chunks.move_to_end(key)
                continue
            if not self._make_room():
                break
            self.chunks[key] = known
            self._announce(known)
            new += 1
        return new

    def _announce(self, chunk: Chunk) -> None:
        """The KV event of a chunk now in L1 (CPU medium)."""
        extra: list[list[str] | None] = [None] * len(chunk.block_hashes)
        if chunk.cache_salt and chunk.parent_block_hash is None:
            extra[0] = [chunk.cache_salt]
        parent = chunk.parent_block_hash
        self.events.append(
            BlockStored(
                [event_id(h) for h in chunk.block_hashes],
                event_id(parent) if parent else None,
                chunk.token_ids,
                self.block_size,
                MEDIUM_CPU,
                extra,
            )
        )

    def _make_room(self) -> bool:
        """Room for one more chunk in L1: LRU, skipping pinned chunks only without L2."""
        while len(self.chunks) >= self.capacity:
            if self.l2_capacity > 0:
                victim = next(iter(self.chunks), None)
            else:
                victim = next((k for k in self.chunks if k not in self.pins), None)
            if victim is None:
                return False  # everything pinned: skip storing, like a full pinned L1
            self._drop_l1(victim)
        return True

    def _make_room_l2(self) -> bool:
        while len(self.l2) >= self.l2_capacity:
            victim = next((k for k in self.l2 if k not in self.pins), None)
            if victim is None:
                return False  # everything pinned: the write-through skips this chunk
            del self.l2[victim]
        return True

    def _drop_l1(self, key: str) -> bool:
        chunk = self.chunks.pop(key, None)
        if chunk is None:
            return False
        self.events.append(BlockRemoved([event_id(h) for h in chunk.block_hashes], MEDIUM_CPU))
        return True

    def remove(self, key: str, tier: str = "all") -> bool:
        """Delete a chunk from ``tier`` ("l1", "l2" or "all"); whether anything went."""
        gone = tier in ("l1", "all") and self._drop_l1(key)
        if tier in ("l2", "all") and self.l2.pop(key, None) is not None:
            gone = True
        return gone

    def pin(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Pin every full-chunk key of a prefix (stored or not); returns keys pinned."""
        keys = self.chunk_keys(token_ids, cache_salt)
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1
        return len(keys)

    def unpin(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Lower each key's pin count by one; returns the keys the prefix resolves to."""
        keys = self.chunk_keys(token_ids, cache_salt)
        for key in keys:
            count = self.pins.get(key, 0) - 1
            if count > 0:
                self.pins[key] = count
            else:
                self.pins.pop(key, None)
        return len(keys)

    def clear(self) -> int:
        """Empty L1 (LMCache's ``/cache/clear``); L2 keeps its copies."""
        keys = list(self.chunks)
        for key in keys:
            self._drop_l1(key)
        return len(keys)

    def usage_by_salt(self) -> dict[str, int]:
        """Chunks stored per cache salt ("" for unsalted)."""
        out: dict[str, int] = {}
        for chunk in {**self.l2, **self.chunks}.values():
            salt = chunk.cache_salt or ""
            out[salt] = out.get(salt, 0) + 1
        return out
