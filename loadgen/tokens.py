"""Deterministic prompt content: a logical block becomes the same tokens on every engine.

A block is named by ``(namespace, block_id)``; its content is a pseudo-random sequence over a
fixed vocabulary drawn from SHAKE-128 of its name, so it is identical across processes, runs and
machines. A block cut to ``n`` tokens is the first ``n`` tokens of the full block, which keeps a
partial tail a prefix of the complete block.

Two renderings:

* token ids (``/v1/completions`` with ``prompt: [ids]``): ids ``ID_BASE + i`` for vocabulary
  index ``i``; exact block alignment on any engine whose vocabulary is larger than
  ``ID_BASE + len(VOCAB)`` (SmolLM2 has 49,152 ids; the simulator accepts any id).
* text: the words joined by single spaces. Every word has at most three ASCII letters, so
  `` word`` is one token for the simulator's tokenizer (one id per 4 UTF-8 bytes of a piece) and
  for GPT-style byte-level BPE vocabularies (SmolLM2), and text prefixes give token prefixes
  because the pre-tokenizer splits at spaces. Counts per block are then near, not exactly, ``n``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from functools import lru_cache

# 128 common short English words, each a single token in SmolLM2's BPE (leading space form).
VOCAB: tuple[str, ...] = (
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her",
    "was", "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new",
    "now", "old", "see", "two", "way", "who", "boy", "did", "its", "let", "put", "say",
    "she", "too", "use", "big", "end", "far", "few", "got", "low", "own", "run", "set",
    "top", "yes", "yet", "ago", "air", "art", "bad", "bed", "box", "car", "cut", "dog",
    "eat", "eye", "fun", "hot", "job", "key", "law", "lay", "leg", "lot", "map", "may",
    "mix", "net", "oil", "pay", "per", "red", "sea", "sit", "six", "sun", "tax", "ten",
    "try", "war", "win", "act", "add", "age", "aid", "aim", "arm", "ask", "bag", "bar",
    "bit", "bus", "buy", "cat", "cup", "dry", "due", "egg", "fan", "fat", "fee", "fit",
    "fix", "fly", "gap", "gas", "guy", "hat", "hit", "ice", "kid", "lab", "lie", "lip",
    "odd", "off", "pen", "pet", "pie", "pot", "raw", "row",
)  # fmt: skip
_MASK = len(VOCAB) - 1  # len(VOCAB) is a power of two, so masking a byte is uniform
ID_BASE = 1000
"""Token id of ``VOCAB[0]`` in the ids rendering."""

Piece = tuple[str, int, int]
"""``(namespace, block_id, n_tokens)``: the first ``n_tokens`` tokens of one logical block."""

assert len(VOCAB) == 128 and len(set(VOCAB)) == 128


@lru_cache(maxsize=32768)
def _indices(namespace: str, block_id: int, n_tokens: int) -> bytes:
    digest = hashlib.shake_128(f"{namespace}\x00{block_id}".encode()).digest(max(n_tokens, 1))
    return bytes(b & _MASK for b in digest[:n_tokens])


def block_ids(namespace: str, block_id: int, n_tokens: int) -> list[int]:
    """Token ids of the first ``n_tokens`` tokens of a block."""
    return [ID_BASE + i for i in _indices(namespace, block_id, n_tokens)]


def block_words(namespace: str, block_id: int, n_tokens: int) -> list[str]:
    """Words (about one token each) of the first ``n_tokens`` tokens of a block."""
    return [VOCAB[i] for i in _indices(namespace, block_id, n_tokens)]


def render_ids(pieces: Iterable[Piece]) -> list[int]:
    """The token ids of a sequence of pieces."""
    out: list[int] = []
    for namespace, block_id, n in pieces:
        out.extend(ID_BASE + i for i in _indices(namespace, block_id, n))
    return out


def render_text(pieces: Iterable[Piece]) -> str:
    """The text of a sequence of pieces: words joined by single spaces."""
    words: list[str] = []
    for namespace, block_id, n in pieces:
        words.extend(VOCAB[i] for i in _indices(namespace, block_id, n))
    return " ".join(words)
