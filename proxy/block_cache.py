"""The block ids of each session's recorded context, learned lazily and cached per replica.

Tokenizing costs an engine round trip and only protected sessions and edits need the ids, so
they are learned here (not on the request path) and stored in Redis with the session's
``last_used`` stamp as their version: every proxy replica sees when another one recorded a new
context.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
import time
from collections.abc import Iterable, Mapping

from adapters.base import AdapterError, EngineRejected
from policy.prefix_index import common_prefix
from proxy.context_cache import ContextCache, ContextView
from proxy.engine_state import EngineState
from proxy.keys import SessionKey
from proxy.store import Session, SessionStore, StoreDown

log = logging.getLogger("kvkeeper.blocks")
_PACK = struct.Struct(">Q")
_VERSION = struct.Struct(">d")  # blocks are stored with the session's last_used stamp

PRUNE_EVERY_S = 30.0  # how often the ids of sessions that are gone are dropped
LEARN_RETRY_S = 2.0  # how long after a failed tokenize the ids are asked for again


def pack_blocks(blocks: Iterable[int]) -> bytes:
    return b"".join(_PACK.pack(b) for b in blocks)


def unpack_blocks(raw: bytes) -> tuple[int, ...]:
    return tuple(v for (v,) in _PACK.iter_unpack(raw[: len(raw) - len(raw) % 8]))


class LearnFailed(Exception):
    """The engine did not tokenize a session's context (busy, down, a bad answer): transient."""


class BlockCache:
    """Session -> (version, block ids), learned from the engine that served the session."""

    def __init__(self, store: SessionStore, engines: Mapping[str, EngineState]) -> None:
        self.store = store
        self.engines = engines
        self._blocks: dict[SessionKey, tuple[float, tuple[int, ...]]] = {}
        self._learn_retry: dict[SessionKey, float] = {}  # when to ask again (monotonic)
        self._pruned_at = time.time()
        self._tokenize = asyncio.Semaphore(8)
        # decoded contexts, token ids, block ids: shared with touches and tier pins
        self.contexts = ContextCache()

    async def blocks_of(
        self, key: SessionKey, session: Session | None = None, *, active_s: float = 0.0
    ) -> tuple[int, ...]:
        """The block ids of the session's recorded context, recomputed only when it changed.

        A session used within the last ``active_s`` seconds keeps the ids learned before: it
        needs no touch while it runs, and is re-learned once when it pauses.
        """
        if session is None:
            session = await self.store.get(*key)
            if session is None:
                return ()
        version = session.last_used
        cached = self._blocks.get(key)
        old = cached[1] if cached is not None else ()
        if cached is not None and (
            cached[0] == version or time.time() - session.last_used < active_s
        ):
            return old
        es = self.engines.get(session.engine or "")
        if es is not None and es.no_tokenize:  # nobody can learn them: skip the reads
            return old
        if time.monotonic() < self._learn_retry.get(key, -math.inf):
            return old
        raw = await self.store.get_blocks(*key)
        if raw is not None and len(raw) >= 8 and _VERSION.unpack(raw[:8])[0] == version:
            blocks = unpack_blocks(raw[8:])
        else:
            try:
                blocks = await self._learn(session) or ()
            except LearnFailed as exc:  # the engine did not answer: ask again, not every tick
                log.debug("block ids of %s not learned yet: %s", key.session_id, exc)
                self._learn_retry[key] = time.monotonic() + LEARN_RETRY_S
                return old
        self._learn_retry.pop(key, None)
        self._blocks[key] = (version, blocks)
        return blocks

    def current(self, key: SessionKey, version: float) -> bool:
        """Whether the cached ids are those of the session's ``version``."""
        cached = self._blocks.get(key)
        return cached is not None and cached[0] == version

    def known(self, key: SessionKey) -> tuple[int, ...]:
        """The session's block ids as last learned here (no I/O: for placement)."""
        cached = self._blocks.get(key)
        return cached[1] if cached is not None else ()

    def shared_prefix(self, key: SessionKey, blocks: tuple[int, ...]) -> int:
        """Leading blocks of ``blocks`` that another session learned here also starts with
        (any tenant: block ids chain over the content and its cache salt)."""
        if not blocks:
            return 0
        return max(
            (
                common_prefix(blocks, theirs)
                for other, (_, theirs) in self._blocks.items()
                if other != key and theirs and theirs[0] == blocks[0]
            ),
            default=0,
        )

    def forget(self, key: SessionKey) -> None:
        self._blocks.pop(key, None)
        self._learn_retry.pop(key, None)
        self.contexts.forget(key)

    async def prune(self, now: float) -> list[SessionKey]:
        """Drop the sessions the store no longer has, at most every ``PRUNE_EVERY_S``; which."""
        if now - self._pruned_at < PRUNE_EVERY_S:
            return []
        self._pruned_at = now
        keys, gone = list(self._blocks), []
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            pairs: list[tuple[str, str]] = list(chunk)
            for key, alive in zip(chunk, await self.store.exist(pairs), strict=True):
                if not alive:
                    self.forget(key)
                    gone.append(key)
        return gone

    async def _learn(self, session: Session) -> tuple[int, ...] | None:
        es = self.engines.get(session.engine or "")
        blob = await self.store.get_context(session.tenant, session.session_id)
        if es is None or blob is None:
            return None
        key = SessionKey(session.tenant, session.session_id)
        blocks = await self._block_ids(es, key, await self.contexts.view(key, blob))
        if blocks is None:
            return None
        es.signals.note_used(blocks, session.last_used or time.time())
        payload = _VERSION.pack(session.last_used) + pack_blocks(blocks)
        with contextlib.suppress(StoreDown):
            await self.store.set_blocks(session.tenant, session.session_id, payload)
        return blocks

    async def _block_ids(
        self, es: EngineState, key: SessionKey, view: ContextView
    ) -> tuple[int, ...] | None:
        ctx = view.ctx
        if not es.adapter.tokenizable(ctx.route) or es.no_tokenize:
            return None
        try:
            async with self._tokenize:
                await self.contexts.tokens(key, view, es)
        except EngineRejected as exc:
            if exc.status in (404, 405):  # no tokenizer route on this engine: stop asking
                es.no_tokenize = True
                log.warning("%s serves no tokenizer: block ids unknown", es.name)
                return None
            raise LearnFailed(str(exc)) from exc
        except (AdapterError, KeyError, ValueError, TypeError) as exc:
            raise LearnFailed(str(exc)) from exc
        ids = await self.contexts.block_ids(key, view, es)
        offset = ctx.block_offset
        return tuple(ids[:offset] if offset is not None else ids)
