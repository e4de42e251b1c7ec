"""Protected sessions in the order they come due, so a tick examines only the due ones.

Every time-based retention decision on an idle session is a threshold on one position, its
last use or touch (``last_active_at``): a keep-alive touch is due once ``last_active_at +
interval <= now`` (one interval for all sessions of an engine, from its horizon), and the
allocation front's reach (blocks stored since then) only grows as the position gets older.
So the due sessions are always a prefix of the sessions ordered by position, whatever the
horizon does, and :meth:`DueOrder.due` walks that prefix, not all sessions.

Pure: positions and predicates are arguments, nothing does I/O.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DueOrder(Generic[K]):
    """Keys ordered by a position (oldest first); set/discard O(log n), due O(d log n)."""

    def __init__(self) -> None:
        self._pos: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._order = itertools.count()
        self.examined = 0  # heap entries looked at by the last due() (tests, benchmarks)

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def set(self, key: K, position: float) -> None:
        """Place ``key`` at ``position`` (a changed session: its new last use)."""
        if self._pos.get(key) == position:
            return
        self._pos[key] = position
        heapq.heappush(self._heap, (position, next(self._order), key))
        if len(self._heap) > 2 * len(self._pos) + 1024:  # entries of moved or dropped keys
            self._compact()

    def discard(self, key: K) -> None:
        self._pos.pop(key, None)

    def due(self, is_due: Callable[[float], bool]) -> list[K]:
        """Keys whose position satisfies ``is_due``, oldest first; ``is_due`` must hold for
        every position older than one it holds for (a prefix)."""
        heap, taken, out = self._heap, [], []
        seen: set[K] = set()
        self.examined = 0
        while heap:
            pos, _, key = heap[0]
            self.examined += 1
            if self._pos.get(key) != pos or key in seen:  # moved, dropped or re-added since
                heapq.heappop(heap)
                continue
            if not is_due(pos):
                break
            taken.append(heapq.heappop(heap))
            seen.add(key)
            out.append(key)
        for entry in taken:
            heapq.heappush(heap, entry)
        return out

    def _compact(self) -> None:
        self._heap = [(p, next(self._order), k) for k, p in self._pos.items()]
        heapq.heapify(self._heap)
