"""The per-session context cache: one decode, tokenize and hashing per context version, and the
block ids always those a fresh computation gives (vLLM's sha256_cbor chain, cache salt too)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest

from adapters import block_hash
from adapters.base import BlockChain, CacheConfig
from adapters.block_hash import BlockHasher
from adapters.vllm import VLLMAdapter
from proxy.context import encode_context
from proxy.context_cache import ContextCache
from proxy.engine_state import EngineState
from proxy.keys import SessionKey

ROUTE = "/v1/completions"
HASHER = BlockHasher(block_size=16, hash_seed="0")


class CountingAdapter(VLLMAdapter):
    """The vLLM adapter (its block hashing, its chain reuse) with token-id prompts; counts
    tokenize and hashing calls."""

    def __init__(self) -> None:
        http = cast(aiohttp.ClientSession, None)  # (never asked: nothing here does I/O)
        super().__init__("e", "http://127.0.0.1:9", http, cache=CacheConfig(block_size=16))
        self.tokenized = 0
        self.hashed = 0

    async def tokenize(self, route: str, body: dict[str, Any]) -> list[int]:
        self.tokenized += 1
        return [int(t) for t in body["prompt"]]

    async def hash_chain_async(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: Any = None,
        previous: BlockChain | None = None,
    ) -> BlockChain:
        self.hashed += 1
        return await super().hash_chain_async(token_ids, cache_salt=cache_salt, previous=previous)


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


async def test_a_grown_context_hashes_only_its_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    digests = 0
    real = block_hash.sha256_cbor

    def counted(obj: Any) -> bytes:
        nonlocal digests
        digests += 1
        return real(obj)

    monkeypatch.setattr(block_hash, "sha256_cbor", counted)
    cache, (es, _) = ContextCache(), engine()
    key, tokens = SessionKey("t", "s"), list(range(16 * 50 + 3))
    view = await cache.view(key, blob(tokens, salt="a"))
    await cache.block_ids(key, view, es)
    grown = tokens + list(range(9000, 9000 + 16 * 4))  # 50 -> 54 full blocks
    view = await cache.view(key, blob(grown, salt="a"))
    digests = 0
    assert await cache.block_ids(key, view, es) == HASHER.block_ids(grown, cache_salt="a")
    assert digests == 4 + 55  # (the reference: 54 blocks + its NONE_HASH)
    edited = [*grown[:100], 7, *grown[101:]]  # a change in block 6: blocks 0-5 reused
    view = await cache.view(key, blob(edited, salt="a"))
    digests = 0
    assert await cache.block_ids(key, view, es) == HASHER.block_ids(edited, cache_salt="a")
    assert digests == 54 - 6 + 55
    view = await cache.view(key, blob(edited, salt="b"))  # another salt: nothing reused
    digests = 0
    assert await cache.block_ids(key, view, es) == HASHER.block_ids(edited, cache_salt="b")
    assert digests == 55 + 55  # (its NONE_HASH too)
    shorter = edited[: 16 * 20]
    view = await cache.view(key, blob(shorter, salt="b"))  # a cut context: all 20 reused
    digests = 0
    assert await cache.block_ids(key, view, es) == HASHER.block_ids(shorter, cache_salt="b")
    assert digests == 21
    cache.forget(key)  # forgotten: the next version hashes from scratch
    view = await cache.view(key, blob(grown, salt="a"))
    digests = 0
    await cache.block_ids(key, view, es)
    assert digests == 54 + 1  # (+ the NONE_HASH)


async def test_another_block_size_reuses_nothing() -> None:
    cache, (es, adapter) = ContextCache(), engine()
    key, tokens = SessionKey("t", "s"), list(range(16 * 8))
    await cache.block_ids(key, await cache.view(key, blob(tokens)), es)
    adapter.cache = CacheConfig(block_size=32)  # the engine rediscovered: another geometry
    view = await cache.view(key, blob(tokens + [1] * 32))
    fresh = BlockHasher(block_size=32).block_ids(tokens + [1] * 32)
    assert await cache.block_ids(key, view, es) == fresh and len(fresh) == 5


async def test_random_versions_always_equal_fresh_hashing() -> None:
    rng = random.Random(28)
    cache, (es, _) = ContextCache(), engine()
    key, tokens, salt = SessionKey("t", "s"), list(range(200)), None
    for _ in range(60):
        step = rng.choice(("grow", "grow", "cut", "edit", "salt"))
        if step == "grow":
            tokens = tokens + [rng.randrange(50_000) for _ in range(rng.randrange(1, 90))]
        elif step == "cut":
            tokens = tokens[: rng.randrange(1, len(tokens) + 1)]
        elif step == "edit":
            i = rng.randrange(len(tokens))
            tokens = [*tokens[:i], rng.randrange(50_000), *tokens[i + 1 :]]
        else:
            salt = rng.choice((None, "a", "b"))
        view = await cache.view(key, blob(tokens, salt=salt))
        assert await cache.block_ids(key, view, es) == HASHER.block_ids(tokens, cache_salt=salt)
