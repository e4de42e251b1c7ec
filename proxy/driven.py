"""The protected sessions one retention worker drives, kept in step with the store's mirror.

Followed by the mirror's change log (``SessionStore.changed_since``): a tick applies the
sessions changed since the last one, re-learns block ids only of those whose ids are not
current, and walks its sessions in due order (``policy.due``), so its per-session work follows
the changed and due sessions, not all protected ones.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection

from policy.due import DueOrder
from proxy.block_cache import BlockCache
from proxy.keys import SessionKey
from proxy.store import Session, SessionStore


class Driven:
    """One engine's driven sessions: by key, their block ids, and their due order."""

    def __init__(self) -> None:
        self.sessions: dict[SessionKey, Session] = {}
        self.blocks: dict[SessionKey, tuple[int, ...]] = {}
        self.order: DueOrder[SessionKey] = DueOrder()
        self.stale: set[SessionKey] = set()  # block ids not current: (re)learn them
        self.refs: Counter[int] = Counter()  # block id -> driven sessions holding it
        self.guessed: set[SessionKey] = set()  # protected by kvkeeper's guess, not the client
        self.mark = -1
        self.applied = 0  # changes applied by the last sync (tests, benchmarks)
        self.learned = 0  # stale sessions visited by the last tick (tests, benchmarks)

    @property
    def examined(self) -> int:
        """Sessions the last tick looked at: changes applied, ids re-learned, due order walked."""
        return self.applied + self.learned + self.order.examined

    async def sync(
        self, store: SessionStore, now: float, drives: Callable[[Session], bool]
    ) -> None:
        """Bring the store's mirror up to date (as of ``now``), then apply its changes since
        the last sync (all of it the first time)."""
        await store.refresh_protected(now)
        self.mark, changed = store.changed_since(self.mark)
        if changed is None:
            for key in list(self.sessions):
                self.drop(key)
            listed = store.mirrored_all()
            for s in listed:
                self._put(SessionKey(s.tenant, s.session_id), s, drives)
            self.applied = len(listed)
            return
        for tk in dict.fromkeys(changed):
            key = SessionKey(*tk)
            found = store.mirrored(tk)
            if found is None:
                self.drop(key)
            else:
                self._put(key, found, drives)
        self.applied = len(changed)

    def _put(self, key: SessionKey, s: Session, drives: Callable[[Session], bool]) -> None:
        # a session that has not finished a request yet has no recorded context to touch
        if s.last_used <= 0 or not drives(s):
            self.drop(key)
            return
        self.sessions[key] = s
        if s.guessed:
            self.guessed.add(key)
        else:
            self.guessed.discard(key)
        self.order.set(key, s.last_active)
        self.stale.add(key)

    def relearn(self, key: SessionKey) -> None:
        """The block cache forgot the session's ids: learn them again."""
        if key in self.sessions:
            self.stale.add(key)

    def drop(self, key: SessionKey) -> None:
        if self.sessions.pop(key, None) is not None:
            self.set_blocks(key, ())
            self.blocks.pop(key, None)
        self.order.discard(key)
        self.stale.discard(key)
        self.guessed.discard(key)

    def clients(self, held: set[SessionKey], kept: set[SessionKey] | None) -> int:
        """Client-protected sessions that may need touches: not held by the tier, not lapsed
        (``kept``: those the budget keeps, None: all)."""
        if kept is not None:
            return len(kept - self.guessed)
        return len(self.sessions) - len(self.guessed) - len(held - self.guessed)

    def set_blocks(self, key: SessionKey, blocks: tuple[int, ...]) -> None:
        old = self.blocks.get(key, ())
        if old == blocks:
            self.blocks[key] = blocks
            return
        self.refs.subtract(old)
        for b in set(old):
            if self.refs[b] <= 0:
                del self.refs[b]
        self.refs.update(blocks)
        self.blocks[key] = blocks

    async def learn(self, cache: BlockCache, active_s: float) -> None:
        """Block ids of the stale sessions (changed, or not learned yet); current ones leave."""
        self.learned = len(self.stale)
        for key in list(self.stale):
            # the loop is the data plane's too: requests waiting for it wait for one session's
            # block ids (a context decoded and hashed), not for the whole tick
            await asyncio.sleep(0)
            s = self.sessions.get(key)
            if s is None:
                continue
            self.set_blocks(key, await cache.blocks_of(key, s, active_s=active_s))
            if cache.current(key, s.last_used):
                self.stale.discard(key)

    def due(
        self,
        in_flight: Collection[SessionKey],
        held: set[SessionKey],
        kept: set[SessionKey] | None,
        interval: float,
        front: Callable[[float], int],
        limit: float,
        now: float,
    ) -> list[Session]:
        """The sessions a touch can be picked from this tick: those due by time (``interval``
        since their last use) or passed by the allocation front (``front``: blocks stored since
        a time, at least ``limit``), a prefix of the due order, and those with a touch in
        flight (they take its slots); kept by the budget, not held by the tier."""

        def due(last_active: float) -> bool:
            return now >= last_active + interval or front(last_active) >= limit

        keys = {*self.order.due(due), *(k for k in in_flight if k in self.sessions)}
        return [self.sessions[k] for k in keys if k not in held and (kept is None or k in kept)]
