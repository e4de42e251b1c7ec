"""vLLM's KV block and its free queue (``FreeKVCacheBlockQueue``): the LRU eviction order the
block pool and Belady's queue both build on."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Block:
    """One KV block. ``prev``/``next`` link it into the free queue while it is free."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue``: eviction order is head first."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)  # sentinels keep every link operation branch-free
        self._tail = Block(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        """Put blocks at the head, ``blocks[0]`` first."""
        for block in reversed(blocks):
            first = self._head.next
            assert first is not None
            block.prev, block.next = self._head, first
            first.prev = block
            self._head.next = block
            self.num_free += 1

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next
