"""Which replica has seen the longest prefix of this request: routing without tokenizing.

A request's prompt is cut into fixed-size byte chunks and each chunk boundary gets the hash of
everything before it (a hash chain), so two requests share the first ``k`` chain entries exactly
when their prompts share the first ``k`` chunks. Each engine keeps the chain entries of the
requests routed to it in a bounded LRU; the engine holding the deepest entry of a new request's
chain most likely holds its prefix in its KV cache (the approximate radix tree of vllm-router's
``cache_aware`` policy and SGLang's router, at chunk instead of character granularity).

The prompt starts at the first of the body's prompt-bearing keys (``tools``, ``system``,
``messages``, ``prompt``, ``input``), so request options written before it do not break the
match. Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

PROMPT_KEYS = (b'"tools"', b'"system"', b'"messages"', b'"prompt"', b'"input"')


def prompt_start(body: bytes) -> int:
    """Offset of the first prompt-bearing key in a JSON body (0 when none is found)."""
    found = [i for i in (body.find(k) for k in PROMPT_KEYS) if i >= 0]
    return min(found, default=0)


def hash_chain(body: bytes, chunk_bytes: int, max_chunks: int) -> list[bytes]:
    """One 8-byte digest per full chunk of the prompt, each covering everything before it."""
    start = prompt_start(body)
    h = hashlib.blake2b(digest_size=8)
    out: list[bytes] = []
    end = min(len(body), start + chunk_bytes * max_chunks)
    for pos in range(start, end - chunk_bytes + 1, chunk_bytes):
        h.update(body[pos : pos + chunk_bytes])
        out.append(h.copy().digest())
    return out


class PrefixIndex:
    """Per engine: the chain entries it was sent, least recently used dropped beyond capacity.

    An engine's capacity should be what its KV cache holds, in chunks (``set_limit``): the
    engine evicts under LRU too, so an index that remembers more than the cache claims prefixes
    the engine has long dropped, and placement sends their requests to recompute them there.
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._seen: dict[str, OrderedDict[bytes, None]] = {}
        self._limits: dict[str, int] = {}

    def limit(self, engine: str) -> int:
        """The most chain entries held for ``engine``."""
        return self._limits.get(engine, self.capacity)

    def set_limit(self, engine: str, chunks: int) -> None:
        """Hold at most ``chunks`` entries for ``engine`` (at least 1, at most ``capacity``);
        the least recently sent go first."""
        limit = max(1, min(self.capacity, chunks))
        self._limits[engine] = limit
        seen = self._seen.get(engine)
        while seen and len(seen) > limit:
            seen.popitem(last=False)

    def match(self, engine: str, chain: Sequence[bytes]) -> int:
        """How many leading chunks of ``chain`` were sent to ``engine`` (binary search)."""
        seen = self._seen.get(engine)
        if not seen or not chain:
            return 0
        lo, hi = 0, len(chain)  # chain[:lo] known, chain[hi:] unknown
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def size(self, engine: str) -> int:
        """Chain entries held for ``engine``: how much prompt it was asked to cache."""
        seen = self._seen.get(engine)
        return len(seen) if seen else 0

    def insert(self, engine: str, chain: Sequence[bytes]) -> None:
        """Record a request sent to ``engine``. Deepest entries first, so a chain's shallower
        entries are the more recent and LRU drops a chain from its end: ``match`` stays a
        prefix test."""
        seen = self._seen.setdefault(engine, OrderedDict())
        for digest in reversed(chain):
            seen[digest] = None
            seen.move_to_end(digest)
        limit = self.limit(engine)
        while len(seen) > limit:
            seen.popitem(last=False)

    def forget(self, engine: str) -> None:
        """The engine restarted or its cache was reset: it holds nothing."""
        self._seen.pop(engine, None)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
