"""One decode, tokenize and block hashing per recorded-context version, shared by block
learning, tier pins and touches (issue 28: each of them redid all three for an unchanged
context, up to three times per version, on the event loop requests share).

Entries are keyed by session and checked against a digest of the stored blob, so a new
context (or another replica's) is never answered from an old one. Bounded: LRU over sessions
with an entry and an estimated-byte cap; ``forget`` drops a session's entry.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from proxy.context import RecordedContext, decode_context
from proxy.engine_state import EngineState
from proxy.keys import SessionKey

MAX_ENTRIES = 512
MAX_BYTES = 128 << 20
# rough CPython sizes: a list slot plus an int object, per token id and per 64-bit block id
_TOKEN_BYTES = 36
_ID_BYTES = 44
_BODY_PER_BLOB_BYTE = 8  # a decoded JSON body against its LZ4 blob


@dataclass(slots=True)
class ContextView:
    """A decoded context version and what was derived from it (read-only lists: shared)."""

    digest: bytes
    ctx: RecordedContext
    size: int
    tokens: dict[tuple[str, bool], list[int]] = field(default_factory=dict)
    ids: dict[tuple[str, bool], list[int]] = field(default_factory=dict)


class ContextCache:
    """Session -> the latest context version seen, its token ids and block ids per engine."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._views: OrderedDict[SessionKey, ContextView] = OrderedDict()

    def __len__(self) -> int:
        return len(self._views)

    async def view(self, key: SessionKey, blob: bytes) -> ContextView:
        """The decoded context of ``blob`` (the session's stored context), decoded once."""
        digest = hashlib.blake2b(blob, digest_size=16).digest()
        view = self._views.get(key)
        if view is not None and view.digest == digest:
            self._views.move_to_end(key)
            self.hits += 1
            return view
        self.misses += 1
        await asyncio.sleep(0)  # between the read and decoding it, the loop's other work
        view = ContextView(digest, decode_context(blob), len(blob) * _BODY_PER_BLOB_BYTE)
        self._put(key, view)
        return view

    async def tokens(
        self, key: SessionKey, view: ContextView, es: EngineState, *, prefix: bool = False
    ) -> list[int]:
        """Token ids of the view's body (``prefix``: cut at its cache breakpoint) on ``es``."""
        prefix = prefix and view.ctx.breakpoint is not None  # (none: the whole body's tokens)
        slot = (es.name, prefix)
        found = view.tokens.get(slot)
        if found is not None:
            return found
        ctx = view.ctx
        tokens = await es.adapter.tokenize(ctx.route, ctx.prefix_body() if prefix else ctx.body)
        self._grow(key, view, view.tokens, slot, tokens, _TOKEN_BYTES)
        return tokens

    async def block_ids(self, key: SessionKey, view: ContextView, es: EngineState) -> list[int]:
        """Block ids of the whole body's tokens on ``es`` (its ``cache_salt`` honoured)."""
        slot = (es.name, False)
        found = view.ids.get(slot)
        if found is not None:
            return found
        tokens = await self.tokens(key, view, es)
        await asyncio.sleep(0)  # tokenized: the hashes after the loop's other work
        salt: Any = view.ctx.body.get("cache_salt")
        ids = await es.adapter.hash_blocks_async(tokens, cache_salt=salt)
        self._grow(key, view, view.ids, slot, ids, _ID_BYTES)
        return ids

    def forget(self, key: SessionKey) -> None:
        view = self._views.pop(key, None)
        if view is not None:
            self.bytes -= view.size

    def _put(self, key: SessionKey, view: ContextView) -> None:
        self.forget(key)
        self._views[key] = view
        self.bytes += view.size
        self._evict()

    def _grow(
        self,
        key: SessionKey,
        view: ContextView,
        into: dict[tuple[str, bool], list[int]],
        slot: tuple[str, bool],
        values: list[int],
        per_item: int,
    ) -> None:
        into[slot] = values
        added = len(values) * per_item
        view.size += added
        if self._views.get(key) is view:  # (not replaced or dropped meanwhile)
            self.bytes += added
            self._evict()

    def _evict(self) -> None:
        while self._views and (len(self._views) > self.max_entries or self.bytes > self.max_bytes):
            _, view = self._views.popitem(last=False)
            self.bytes -= view.size
