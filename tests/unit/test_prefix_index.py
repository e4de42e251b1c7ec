"""The prompt-chunk prefix index: hash chains, longest match per engine, LRU from the chain end."""

from __future__ import annotations

import json

from policy.prefix_index import PrefixIndex, hash_chain, prompt_start


def body(prompt: list[int], **options: object) -> bytes:
    return json.dumps({**options, "model": "m", "prompt": prompt}).encode()


def test_chains_agree_exactly_as_far_as_the_prompts_do() -> None:
    shared = list(range(1000, 1600))
    a = hash_chain(body(shared + [1] * 300, max_tokens=5), 256, 100)
    b = hash_chain(body(shared + [2] * 300, max_tokens=700, stream=True), 256, 100)
    assert len(a) == len(b) > 10
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    # options before the prompt do not matter; the chains part where the prompts part
    assert common * 256 <= len(json.dumps(shared)) < (common + 1) * 256 + 16
    assert hash_chain(b"{}", 256, 100) == [] and prompt_start(b'{"x":1,"messages":[]}') == 7


def test_match_is_the_deepest_chunk_an_engine_was_sent() -> None:
    idx = PrefixIndex()
    long = hash_chain(body(list(range(5000))), 128, 1000)
    short = long[:10]
    idx.insert("a", long)
    idx.insert("b", short)
    assert idx.match("a", long) == len(long) and idx.match("b", long) == 10
    assert idx.match("c", long) == 0 and idx.match("a", []) == 0
    assert (idx.size("a"), idx.size("b"), idx.size("c")) == (len(long), 10, 0)
    idx.insert("b", long)  # shared entries count once: what the engine is asked to hold
    assert idx.size("b") == len(long)
    idx.forget("a")
    assert idx.match("a", long) == 0 and idx.size("a") == 0


def test_lru_drops_chains_from_their_end_so_matches_stay_prefixes() -> None:
    idx = PrefixIndex(capacity=30)
    old = hash_chain(body(list(range(3000))), 128, 1000)[:20]
    new = hash_chain(body(list(range(9000, 12000))), 128, 1000)[:20]
    idx.insert("a", old)
    idx.insert("a", new)  # 40 entries for 30 places: 10 of the old chain go, deepest first
    assert idx.match("a", new) == 20
    assert idx.match("a", old) == 10 and idx.size("a") == 30


def test_a_per_engine_limit_bounds_what_the_index_claims_an_engine_holds() -> None:
    idx = PrefixIndex(capacity=100)
    old = hash_chain(body(list(range(3000))), 128, 1000)[:20]
    new = hash_chain(body(list(range(9000, 12000))), 128, 1000)[:20]
    idx.insert("a", old)
    idx.insert("b", old)
    idx.set_limit("a", 25)  # a's cache holds 25 chunks: the new chain pushes the old one out
    idx.insert("a", new)
    assert (idx.match("a", new), idx.match("a", old), idx.size("a")) == (20, 5, 25)
    assert idx.match("b", old) == 20 and idx.limit("b") == 100  # other engines keep theirs
    idx.set_limit("a", 10)  # shrinking drops the least recently sent at once
    assert (idx.match("a", new), idx.match("a", old), idx.size("a")) == (10, 0, 10)
    idx.set_limit("b", 10**9)  # never above the index's own capacity, never below 1
    idx.set_limit("a", 0)
    assert (idx.limit("b"), idx.limit("a"), idx.size("a")) == (100, 1, 1)
