"""The protected sessions one retention worker drives, kept in step with the store's mirror.

Followed by the mirror's change log (``SessionStore.changed_since``): a tick applies the
sessions changed since the last one, re-learns block ids only of those whose ids are not
current, and walks its sessions in due order (``policy.due``), so its per-session work follows
the changed and due sessions, not all protected ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from policy.due import DueOrder
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
        self.mark = -1
        self.applied = 0  # changes applied by the last sync (tests, benchmarks)
        self.learned = 0  # stale sessions visited by the last tick (tests, benchmarks)

    @property
    def examined(self) -> int:
        """Sessions the last tick looked at: changes applied, ids re-learned, due order walked."""
        return self.applied + self.learned + self.order.examined

    def sync(self, store: SessionStore, drives: Callable[[Session], bool]) -> None:
        """Apply the mirror's changes since the last sync (all of it the first time)."""
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
        self.order.set(key, s.last_active)
        self.stale.add(key)

    def drop(self, key: SessionKey) -> None:
        if self.sessions.pop(key, None) is not None:
            self.set_blocks(key, ())
            self.blocks.pop(key, None)
        self.order.discard(key)
        self.stale.discard(key)

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
