"""One decode, tokenize and block hashing per recorded-context version, shared by block
learning, tier pins and touches (issue 28: each of them redid all three for an unchanged
context, up to three times per version, on the event loop requests share).

Entries are keyed by session and checked against a digest of the stored blob, so a new
context (or another replica's) is never answered from an old one. A new version keeps the
previous one's block chain per engine until it is hashed: a context that grew hashes only its
new blocks. Bounded: LRU over sessions with an entry and an estimated-byte cap; ``forget`` drops
a session's entry.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from adapters.base import BlockChain
from proxy.context import RecordedContext, decode_context
from proxy.engine_state import EngineState
from proxy.keys import SessionKey

MAX_ENTRIES = 512
MAX_BYTES = 128 << 20
# rough CPython sizes: a list slot plus an int object per token id; per block its 64-bit id
# and its chained value (a 32-byte digest for vLLM)
_TOKEN_BYTES = 36
_BLOCK_BYTES = 120
_BODY_PER_BLOB_BYTE = 8  # a decoded JSON body against its LZ4 blob


@dataclass(slots=True)
class ContextView:
    """A decoded context version and what was derived from it (read-only lists: shared)."""

    digest: bytes
    ctx: RecordedContext
    size: int
    tokens: dict[tuple[str, bool], list[int]] = field(default_factory=dict)
    chains: dict[str, BlockChain] = field(default_factory=dict)  # per engine
    previous: dict[str, BlockChain] = field(default_factory=dict)  # the last version's


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
        ctx = decode_context(blob)
        await asyncio.sleep(0)  # decoded: what uses it after the loop's other work
        old = self._views.get(key)
        previous = {**old.previous, **old.chains} if old is not None else {}
        size = len(blob) * _BODY_PER_BLOB_BYTE + sum(map(_chain_bytes, previous.values()))
        view = ContextView(digest, ctx, size, previous=previous)
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
        view.tokens[slot] = tokens
        self._resize(key, view, len(tokens) * _TOKEN_BYTES)
        return tokens

    async def block_ids(self, key: SessionKey, view: ContextView, es: EngineState) -> list[int]:
        """Block ids of the whole body's tokens on ``es`` (its ``cache_salt`` honoured); the
        leading blocks the previous version shares are not hashed again."""
        found = view.chains.get(es.name)
        if found is not None:
            return found.ids
        tokens = await self.tokens(key, view, es)
        await asyncio.sleep(0)  # tokenized: the hashes after the loop's other work
        salt: Any = view.ctx.body.get("cache_salt")
        previous = view.previous.get(es.name)
        chain = await es.adapter.hash_chain_async(tokens, cache_salt=salt, previous=previous)
        if previous is not None and view.previous.pop(es.name, None) is previous:
            self._resize(key, view, -_chain_bytes(previous))
        view.chains[es.name] = chain
        self._resize(key, view, len(chain.ids) * _BLOCK_BYTES)
        return chain.ids

    def forget(self, key: SessionKey) -> None:
        view = self._views.pop(key, None)
        if view is not None:
            self.bytes -= view.size

    def _put(self, key: SessionKey, view: ContextView) -> None:
        self.forget(key)
        self._views[key] = view
        self.bytes += view.size
        self._evict()

    def _resize(self, key: SessionKey, view: ContextView, added: int) -> None:
        view.size += added
        if self._views.get(key) is view:  # (not replaced or dropped meanwhile)
            self.bytes += added
            self._evict()

    def _evict(self) -> None:
        while self._views and (len(self._views) > self.max_entries or self.bytes > self.max_bytes):
            _, view = self._views.popitem(last=False)
            self.bytes -= view.size


def _chain_bytes(chain: BlockChain) -> int:
    """What a kept chain holds alive: its blocks, and its tokens (the old version's list)."""
    return len(chain.ids) * _BLOCK_BYTES + len(chain.tokens) * _TOKEN_BYTES
