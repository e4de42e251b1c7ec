"""The script batcher's RESP packing: the text fast path writes the same bytes as packing each
value, and falls back for bytes and non-ASCII text (a lone surrogate still raises)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from proxy.batching import Arg, _bulk, pack_tail
from proxy.hint_model import Hint
from proxy.settings import Limits
from proxy.store import SessionStore, Usage
from proxy.store_writes import UPSERT_ARGS, UPSERT_KEYS

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
        ["a", 7, b"ctx", 2.5, "\u00e9", b"", b"z", "tail", 3],  # text runs between bytes
        [1, b"end"],
        [],
    ],
)
def test_pack_tail_matches_packing_each_value(args: list[Arg]) -> None:
    assert pack_tail(KEYS, args) == _reference(KEYS, args)


def test_pack_tail_rejects_a_lone_surrogate() -> None:
    with pytest.raises(UnicodeEncodeError):
        pack_tail(KEYS, ["evil\ud800"])


@pytest.mark.parametrize(
    "hint",
    [
        Hint("s1", ttl_s=300.0),
        Hint("s\u00e9", parent_session_id="p", agent_name="planner", retention="extended"),
        Hint("s2", ttl_s=0.0),
    ],
)
def test_upsert_template_packs_the_same_call(hint: Hint) -> None:
    """A known session's repeat sends its upsert from a template packed once: the same bytes
    as packing the whole call (proxy/known.py)."""
    store = SessionStore(Redis(), Limits(), namespace="kvk")  # nothing is sent
    template = store.upsert_template("t", hint)
    for now, requests in ((1733372400.125, 1), (1733372401.5, 7)):
        n, tail = pack_tail(*store._upsert_call("t", hint, now, requests))
        assert n == 1 + UPSERT_KEYS + UPSERT_ARGS
        assert store._tail(template, now, requests) == tail


def test_completion_records_pack_the_same_call() -> None:
    """Finished requests are packed from each session's cached keys and ids: the same bytes as
    packing the whole ``complete`` call value by value."""
    store = SessionStore(Redis(), Limits(), namespace="kvk")  # nothing is sent
    records = [
        (
            "t",
            "s1",
            1733372400.125,
            "http://e1:8000",
            Usage(90, 64, 1),
            Usage(180, 128, 2),
            b"\x00c",
        ),
        ("t", "s\u00e9", 1733372401.5, "engine-\u00e9", Usage(), Usage(7, 0, 3), b""),
        ("u", "s1", 1733372402.0, "http://e1:8000", Usage(5, 5, 5), Usage(5, 5, 5), b"ctx"),
    ]
    feed = store.feed_keys("")
    for _ in range(2):  # the second time from the cached parts
        assert store._complete_tail(records, feed) == pack_tail(
            *store._complete_call(records, feed)
        )
