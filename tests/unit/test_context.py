"""Recorded contexts: the blob kvkeeper stores per session and decodes to touch or warm it."""

from __future__ import annotations

import json
import zlib

import pytest

from proxy.context import MAGIC, decode_context, encode_context

BODY = {"model": "m", "messages": [{"role": "system", "content": "tool defs " * 2000}]}


def test_round_trip_keeps_route_breakpoint_and_body() -> None:
    raw = json.dumps(BODY).encode()
    blob = encode_context("/v1/messages", raw, ("system", 0), block_offset=3)
    assert blob.startswith(MAGIC)
    assert len(blob) < len(raw) / 4  # a repetitive agent prompt compresses well
    ctx = decode_context(blob)
    assert (ctx.route, ctx.breakpoint, ctx.block_offset) == ("/v1/messages", ("system", 0), 3)
    assert ctx.body == BODY


def test_reads_zlib_blobs_of_earlier_versions() -> None:
    # what encode_context wrote before LZ4: sessions recorded then stay usable after an upgrade
    header = b'{"route":"/v1/chat/completions","breakpoint":null,"block_offset":null}'
    blob = b"KVK1" + header + b"\n" + zlib.compress(json.dumps(BODY).encode(), 1)
    ctx = decode_context(blob)
    assert ctx.route == "/v1/chat/completions" and ctx.breakpoint is None
    assert ctx.body == BODY


def test_rejects_foreign_blobs() -> None:
    with pytest.raises(ValueError, match="not a kvkeeper context blob"):
        decode_context(b"JUNK" + b"{}\n")
