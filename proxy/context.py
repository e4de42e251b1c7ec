"""The recorded context of a session: what kvkeeper re-sends to touch or warm its prefix.

Blob layout: a 4-byte magic + one JSON header line (route, breakpoint) + the compressed request
body. ``KVK2`` bodies are LZ4 blocks: every hinted request's context is re-encoded when it
finishes, and LZ4 compresses an agent-sized prompt several times faster than zlib at its fastest
level, at about the same ratio. ``KVK1`` (zlib) blobs written by earlier versions are still read.
"""

from __future__ import annotations

import functools
import json
import zlib
from dataclasses import dataclass
from typing import Any

import lz4.block

from adapters import wire

MAGIC = b"KVK2"
_ZLIB_MAGIC = b"KVK1"


@dataclass(frozen=True, slots=True)
class RecordedContext:
    route: str
    body: dict[str, Any]
    breakpoint: tuple[str, int] | None = None
    block_offset: int | None = None  # protect only the first N blocks (RFC cache_control)

    def prefix_body(self) -> dict[str, Any]:
        """The body cut at the Anthropic cache breakpoint (the protected prefix), if any."""
        if self.breakpoint is None:
            return dict(self.body)
        section, index = self.breakpoint
        body = dict(self.body)
        if index >= 0 and isinstance(body.get(section), list):
            body[section] = body[section][: index + 1]
            if section in ("tools", "system"):  # nothing after the breakpoint's section
                body["messages"] = body.get("messages", [])[:1]
        return body


def encode_context(
    route: str,
    body: bytes,
    breakpoint: tuple[str, int] | None = None,
    block_offset: int | None = None,
) -> bytes:
    payload: bytes = lz4.block.compress(body)
    return _header(route, breakpoint, block_offset) + payload


@functools.lru_cache(maxsize=256)
def _header(route: str, breakpoint: tuple[str, int] | None, block_offset: int | None) -> bytes:
    meta = {"route": route, "breakpoint": breakpoint, "block_offset": block_offset}
    return MAGIC + json.dumps(meta, separators=(",", ":")).encode() + b"\n"


def decode_context(blob: bytes) -> RecordedContext:
    magic = blob[: len(MAGIC)]
    if magic not in (MAGIC, _ZLIB_MAGIC):
        raise ValueError("not a kvkeeper context blob")
    header, _, payload = blob[len(MAGIC) :].partition(b"\n")
    meta = json.loads(header)
    raw: bytes = lz4.block.decompress(payload) if magic == MAGIC else zlib.decompress(payload)
    body = wire.loads(raw)  # orjson: a 100K-token context decodes on the shared event loop
    bp = meta.get("breakpoint")
    return RecordedContext(
        meta["route"], body, (bp[0], int(bp[1])) if bp else None, meta.get("block_offset")
    )
