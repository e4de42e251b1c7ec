"""The script batcher's RESP packing: the text fast path writes the same bytes as packing each
value, and falls back for bytes and non-ASCII text (a lone surrogate still raises)."""

from __future__ import annotations

import pytest

from proxy.batching import Arg, _bulk, pack_tail

KEYS: list[Arg] = ["kvk:s:t:sess1", "kvk:idx:t", "", "kvk:ch:t:sess1"]


def _reference(keys: list[Arg], args: list[Arg]) -> tuple[int, bytes]:
    items: list[Arg] = [len(keys), *keys, *args]
    return len(items), b"".join(_bulk(v) for v in items)


@pytest.mark.parametrize(
    "args",
    [
        ["1733372400.123", "sess1", "t", "", 10_000, 256, -3, True, 1.5, 2.5e-7, float("inf")],
        ["é", "t\x1fsess1"],  # non-ASCII: packed per value (length in bytes)
        [b"\x00\xff", "x"],  # bytes (a context blob)
        [],
    ],
)
def test_pack_tail_matches_packing_each_value(args: list[Arg]) -> None:
    assert pack_tail(KEYS, args) == _reference(KEYS, args)


def test_pack_tail_rejects_a_lone_surrogate() -> None:
    with pytest.raises(UnicodeEncodeError):
        pack_tail(KEYS, ["evil\ud800"])
