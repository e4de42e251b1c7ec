"""The residency index: prefixes per medium, stored/removed times, eviction ages, LRU horizon."""

from __future__ import annotations

import time

import pytest

from adapters.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from adapters.residency import ResidencyIndex


def batch(*events: KVEvent) -> EventBatch:
    return EventBatch(ts=0.0, events=events)


def stored(hashes: list[int], medium: str = "GPU") -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 32, medium)


def test_leading_prefix_per_medium() -> None:
    index = ResidencyIndex()
    index.apply(batch(stored([1, 2, 3, 4])), now=10.0)
    index.apply(batch(stored([1, 2], medium="CPU")), now=11.0)
    assert index.resident_prefix([1, 2, 3, 4, 5]) == 4
    assert index.resident_prefix([1, 2, 3, 4], medium="CPU") == 2
    assert index.resident_prefix([9, 1, 2]) == 0
    assert index.prefix_by_medium([1, 2, 3]) == {"GPU": 3, "CPU": 2}
    assert index.stored_at(3) == 10.0
    assert index.stored_at(1, "CPU") == 11.0
    assert index.size() == 4
    assert index.media() == ["CPU", "GPU"]

    index.apply(batch(BlockRemoved((2,), "GPU")), now=12.0)
    assert index.resident_prefix([1, 2, 3, 4]) == 1
    assert index.resident_count([1, 2, 3, 4]) == 3
    # Block 2 still sits in the CPU tier, so the prefix is loadable without recompute.
    assert index.resident_prefix_any([1, 2, 3, 4]) == 4
    assert index.removed_at(2) == 12.0
    assert index.removed_at(3) is None
    assert index.is_resident(2, "CPU")
    assert not index.is_resident(2)


def test_clear_and_all_blocks_cleared() -> None:
    index = ResidencyIndex()
    index.apply(batch(stored([1, 2]), stored([3], medium="CPU")))
    index.apply(batch(AllBlocksCleared(), stored([7])))
    assert index.size() == 1
    assert index.size("CPU") == 0
    assert index.is_resident(7)
    index.clear()
    assert index.size() == 0
    assert index.clears == 2


def test_eviction_ages_and_lru_horizon() -> None:
    index = ResidencyIndex()
    assert index.lru_horizon(now=0.0) is None
    index.apply(batch(stored(list(range(10)))), now=0.0)
    index.note_used(range(10), now=100.0)
    index.note_used([0, 1], now=150.0)  # a touch refreshed blocks 0 and 1
    # Blocks 9..2 are evicted at t=160, 161, ...: each had sat unused 60 s or more.
    for i, h in enumerate(range(9, 1, -1)):
        index.apply(batch(BlockRemoved((h,))), now=160.0 + i)
    ages = index.eviction_ages()
    assert ages == [60.0 + i for i in range(8)]
    assert index.lru_horizon(now=170.0) == 60.0
    assert index.lru_horizon(now=170.0, quantile=0.5) == 64.0
    # Old evictions fall out of the window; evictions of never-used blocks teach nothing.
    assert index.lru_horizon(now=1000.0, window=300.0) is None
    index.apply(batch(stored([50]), BlockRemoved((50,))), now=171.0)
    assert len(index.eviction_ages()) == 8
    # CPU-tier removals are not LRU evictions of the GPU pool.
    index.apply(batch(stored([0], "CPU"), BlockRemoved((0,), "CPU")), now=172.0)
    assert len(index.eviction_ages()) == 8
    assert index.last_used(0) == 150.0


def test_memory_is_bounded() -> None:
    index = ResidencyIndex(max_tracked=100, max_evictions=10)
    index.note_used(range(1000), now=1.0)
    index.apply(batch(stored(list(range(1000)))), now=1.0)
    index.apply(batch(BlockRemoved(tuple(range(1000)))), now=2.0)
    assert index.last_used(999) == 1.0
    assert index.last_used(0) is None  # oldest uses forgotten first
    assert index.removed_at(999) == 2.0
    assert index.removed_at(0) is None
    assert len(index.eviction_ages()) == 10


def test_prefix_lookup_is_fast() -> None:
    index = ResidencyIndex()
    blocks = list(range(100_000))
    index.apply(batch(stored(blocks)))
    started = time.perf_counter()
    for _ in range(10):
        assert index.resident_prefix(blocks) == 100_000
    per_call = (time.perf_counter() - started) / 10
    assert per_call < 0.05  # ~3,000 blocks = a 100K-token context costs far less


@pytest.mark.parametrize("quantile", [0.0, 0.99, 1.0])
def test_horizon_quantile_bounds(quantile: float) -> None:
    index = ResidencyIndex()
    index.note_used([1, 2], now=0.0)
    index.apply(batch(stored([1, 2]), BlockRemoved((1,))), now=5.0)
    index.apply(batch(BlockRemoved((2,))), now=9.0)
    expected = 5.0 if quantile == 0.0 else 9.0
    assert index.lru_horizon(now=9.0, quantile=quantile) == expected
