"""The per-session context cache: one decode, tokenize and hashing per context version, and the
block ids always those a fresh computation gives (vLLM's sha256_cbor chain, cache salt too)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

from adapters.block_hash import BlockHasher
from proxy.context import encode_context
from proxy.context_cache import ContextCache
from proxy.engine_state import EngineState
from proxy.keys import SessionKey

ROUTE = "/v1/completions"
HASHER = BlockHasher(block_size=16, hash_seed="0")


class CountingAdapter:
    """Token-id prompts as the vLLM adapter tokenizes them, vLLM's block hashing; counts calls."""

    def __init__(self) -> None:
        self.tokenized = 0
        self.hashed = 0

    def tokenizable(self, route: str) -> bool:
        return True

    async def tokenize(self, route: str, body: dict[str, Any]) -> list[int]:
        self.tokenized += 1
        return [int(t) for t in body["prompt"]]

    async def hash_blocks_async(
        self, token_ids: Sequence[int], *, cache_salt: Any = None
    ) -> list[int]:
        self.hashed += 1
        return await HASHER.block_ids_async(token_ids, cache_salt=cache_salt)


def engine(name: str = "e") -> tuple[EngineState, CountingAdapter]:
    adapter = CountingAdapter()
    return cast(EngineState, SimpleNamespace(name=name, adapter=adapter)), adapter


def blob(tokens: list[int], salt: str | None = None) -> bytes:
    body: dict[str, Any] = {"model": "m", "prompt": tokens}
    if salt is not None:
        body["cache_salt"] = salt
    return encode_context(ROUTE, json.dumps(body).encode())


async def test_an_unchanged_context_is_decoded_tokenized_and_hashed_once() -> None:
    cache, (es, adapter) = ContextCache(), engine()
    key, tokens = SessionKey("t", "s"), list(range(1000, 1000 + 16 * 40 + 5))
    raw = blob(tokens, salt="tenant-salt")
    seen = []
    for _ in range(3):  # block learning, a tier pin, a touch
        view = await cache.view(key, raw)
        assert await cache.tokens(key, view, es) == tokens
        seen.append(await cache.block_ids(key, view, es))
    assert (cache.misses, cache.hits) == (1, 2)
    assert (adapter.tokenized, adapter.hashed) == (1, 1)
    fresh = HASHER.block_ids(tokens, cache_salt="tenant-salt")
    assert seen == [fresh] * 3 and len(fresh) == 40
    assert fresh != HASHER.block_ids(tokens)  # the salt is part of the ids


async def test_a_new_version_is_recomputed_and_equals_fresh_hashing() -> None:
    cache, (es, adapter) = ContextCache(), engine()
    key, tokens = SessionKey("t", "s"), list(range(16 * 10))
    view = await cache.view(key, blob(tokens))
    assert await cache.block_ids(key, view, es) == HASHER.block_ids(tokens)
    grown = tokens + list(range(5000, 5000 + 16 * 3 + 7))  # the session's next turn
    view = await cache.view(key, blob(grown))
    assert await cache.block_ids(key, view, es) == HASHER.block_ids(grown)
    salted = await cache.view(key, blob(grown, salt="x"))  # same tokens, another salt
    assert await cache.block_ids(key, salted, es) == HASHER.block_ids(grown, cache_salt="x")
    assert (adapter.tokenized, adapter.hashed, cache.misses) == (3, 3, 3)


async def test_engines_and_the_breakpoint_prefix_are_kept_apart() -> None:
    cache, (a, count_a), (b, count_b) = ContextCache(), engine("a"), engine("b")
    key, tokens = SessionKey("t", "s"), list(range(100))
    view = await cache.view(key, blob(tokens))
    await cache.block_ids(key, view, a)
    await cache.block_ids(key, view, b)
    await cache.tokens(key, view, a, prefix=True)  # no breakpoint: the whole body's tokens
    assert (count_a.tokenized, count_b.tokenized, count_a.hashed, count_b.hashed) == (1, 1, 1, 1)
    cut = SessionKey("t", "cut")  # a breakpoint: the prefix is tokenized on its own
    raw = encode_context(ROUTE, json.dumps({"prompt": tokens}).encode(), ("prompt", 9))
    view = await cache.view(cut, raw)
    assert await cache.tokens(cut, view, a, prefix=True) == tokens[:10]
    assert await cache.tokens(cut, view, a) == tokens and count_a.tokenized == 3


async def test_forget_and_the_bounds_drop_entries() -> None:
    es, _ = engine()
    cache = ContextCache(max_entries=3)
    for i in range(5):
        key = SessionKey("t", f"s{i}")
        await cache.block_ids(key, await cache.view(key, blob(list(range(i, i + 64)))), es)
    assert len(cache) == 3  # the two least recently used went
    first = SessionKey("t", "s0")
    await cache.view(first, blob(list(range(64))))
    assert cache.misses == 6  # s0 was evicted: decoded again
    cache.forget(first)
    assert len(cache) == 2 and cache.bytes > 0
    for i in (3, 4):
        cache.forget(SessionKey("t", f"s{i}"))
    assert len(cache) == 0 and cache.bytes == 0

    small = ContextCache(max_bytes=200_000)  # byte cap: 10K-token sessions, ~0.5 MB each
    for i in range(4):
        key = SessionKey("t", f"b{i}")
        view = await small.view(key, blob(list(range(i, i + 10_000))))
        assert await small.block_ids(key, view, es) == HASHER.block_ids(range(i, i + 10_000))
    assert len(small) <= 1 and small.bytes <= 200_000
