"""Per-engine residency index: which block hashes are resident, where, and since when.

Fed by the KV-event subscriber (``apply``/``clear``) and by the proxy, which reports when it last
used each block (``note_used``). From the two it learns the engine's LRU horizon: a
``BlockRemoved`` for a block the proxy last used ``a`` seconds ago shows that blocks idle for
``a`` seconds get evicted under the current load. The retention worker touches protected prefixes
before they get that old.

All operations are dictionary look-ups, O(blocks asked); memory is bounded by ``max_tracked``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat

from adapters.kv_events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


class ResidencyIndex:
    """Resident blocks per medium, last stored/removed times, and observed eviction ages."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        max_tracked: int = 1_000_000,
        max_evictions: int = 4096,
    ) -> None:
        self._clock = clock
        self._max_tracked = max_tracked
        self._resident: dict[str, dict[int, float]] = {}  # medium -> hash -> stored at
        self._removed: OrderedDict[int, float] = OrderedDict()  # hash -> last removed at
        self._last_used: OrderedDict[int, float] = OrderedDict()  # hash -> proxy's last use
        # (removed at, seconds since the proxy's last use) of evicted GPU blocks
        self._evictions: deque[tuple[float, float]] = deque(maxlen=max_evictions)
        self.stored_events = 0
        self.removed_events = 0
        self.clears = 0

    # feeding ------------------------------------------------------------------------------
    def apply(self, batch: EventBatch, now: float | None = None) -> None:
        """Apply one decoded event batch (the ``EventSink`` protocol)."""
        at = self._clock() if now is None else now
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event, at)
            elif isinstance(event, BlockRemoved):
                self._remove(event, at)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        """Forget every resident block (cache reset, engine restart)."""
        self._resident.clear()
        self.clears += 1

    def note_used(self, block_ids: Iterable[int], now: float | None = None) -> None:
        """Record that a request just used these blocks (served, touched or warmed)."""
        at = self._clock() if now is None else now
        for h in block_ids:
            self._last_used[h] = at
            self._last_used.move_to_end(h)
        self._trim(self._last_used)

    def _store(self, event: BlockStored, at: float) -> None:
        self._resident.setdefault(event.medium, {}).update(dict.fromkeys(event.block_hashes, at))
        self.stored_events += 1

    def _remove(self, event: BlockRemoved, at: float) -> None:
        hashes = event.block_hashes
        table = self._resident.get(event.medium)
        if table:
            deque(map(table.pop, hashes, repeat(None)), maxlen=0)  # pops in C
        # re-inserted at the end: the most recently removed last, as move_to_end would
        deque(map(self._removed.pop, hashes, repeat(None)), maxlen=0)
        self._removed.update(dict.fromkeys(hashes, at))
        if event.medium == GPU and self._last_used:
            used = self._last_used
            hits = [h for h in hashes if h in used]
            if self._evictions.maxlen is not None:  # only the newest are kept
                hits = hits[-self._evictions.maxlen :]
            self._evictions.extend(zip(repeat(at), [max(0.0, at - used[h]) for h in hits]))
        self._trim(self._removed)
        self.removed_events += 1

    def _trim(self, table: OrderedDict[int, float]) -> None:
        while len(table) > self._max_tracked:
            table.popitem(last=False)

    # queries ------------------------------------------------------------------------------
    def is_resident(self, block_id: int, medium: str = GPU) -> bool:
        return block_id in self._resident.get(medium, {})

    def resident_prefix(self, block_ids: Sequence[int], medium: str = GPU) -> int:
        """How many leading blocks of ``block_ids`` are resident in ``medium``."""
        table = self._resident.get(medium, {})
        for i, h in enumerate(block_ids):
            if h not in table:
                return i
        return len(block_ids)

    def resident_prefix_any(self, block_ids: Sequence[int]) -> int:
        """Leading blocks resident in at least one medium (loadable without recompute)."""
        tables = list(self._resident.values())
        for i, h in enumerate(block_ids):
            if not any(h in t for t in tables):
                return i
        return len(block_ids)

    def prefix_by_medium(self, block_ids: Sequence[int]) -> dict[str, int]:
        """``resident_prefix`` for every medium seen so far."""
        return {m: self.resident_prefix(block_ids, m) for m in self._resident}

    def resident_count(self, block_ids: Iterable[int], medium: str = GPU) -> int:
        """How many of ``block_ids`` (anywhere in the list) are resident in ``medium``."""
        table = self._resident.get(medium, {})
        return sum(1 for h in block_ids if h in table)

    def stored_at(self, block_id: int, medium: str = GPU) -> float | None:
        return self._resident.get(medium, {}).get(block_id)

    def removed_at(self, block_id: int) -> float | None:
        return self._removed.get(block_id)

    def last_used(self, block_id: int) -> float | None:
        return self._last_used.get(block_id)

    def last_used_many(self, block_ids: Iterable[int]) -> Iterator[float]:
        """The proxy's last use of each block, 0.0 where it has none (no call per block)."""
        return map(self._last_used.get, block_ids, repeat(0.0))

    def size(self, medium: str = GPU) -> int:
        """Number of blocks resident in ``medium``."""
        return len(self._resident.get(medium, {}))

    def media(self) -> list[str]:
        return sorted(self._resident)

    def resident_blocks(self, medium: str = GPU) -> list[int]:
        """Every block resident in ``medium`` (a snapshot for a process that joins late)."""
        return list(self._resident.get(medium, {}))

    # LRU horizon ---------------------------------------------------------------------------
    def eviction_ages(self, since: float | None = None) -> list[float]:
        """Ages (seconds since the proxy's last use) of blocks evicted at or after ``since``."""
        return [age for at, age in self._evictions if since is None or at >= since]

    def lru_horizon(
        self, *, window: float = 300.0, quantile: float = 0.1, now: float | None = None
    ) -> float | None:
        """A low quantile of recent eviction ages: blocks idle this long are at risk.

        None until an eviction of a block with a known last use was seen within ``window`` s.
        A low quantile, not the mean, because a touch scheduled from it must come early.
        """
        at = self._clock() if now is None else now
        ages = sorted(self.eviction_ages(since=at - window))
        if not ages:
            return None
        index = min(len(ages) - 1, max(0, int(quantile * len(ages))))
        return ages[index]
