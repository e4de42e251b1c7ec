"""The admin listing's cursor: positions round-trip, and it only opens for its own listing."""

from __future__ import annotations

import pytest

from proxy.errors import BadRequest
from proxy.session_cursor import MAX_CURSOR_LEN, Position, decode, encode, listing_digest


def test_positions_round_trip_whatever_the_ids() -> None:
    digest = listing_digest("team-a", None, "idle")
    for position in (
        Position("team-a", ""),
        Position("team-a", "s:1/2?x=y&z"),
        Position("équipe", '会话-\x1f-"quoted"'),
    ):
        cursor = encode(position, digest)
        assert cursor.isascii() and "=" not in cursor and len(cursor) <= MAX_CURSOR_LEN
        assert decode(cursor, digest) == position


def test_each_listing_has_its_own_digest() -> None:
    digests = {
        listing_digest(scope, parent, state)
        for scope in (None, "a", "b")
        for parent in (None, "p", "")
        for state in (None, "idle")
    }
    assert len(digests) == 18


def test_foreign_cursor_is_rejected_with_the_cursor_param() -> None:
    cursor = encode(Position("a", "s1"), listing_digest("a", None, None))
    with pytest.raises(BadRequest) as err:
        decode(cursor, listing_digest("b", None, None))
    assert err.value.param == "cursor" and "another listing" in str(err.value)
    for broken in (cursor[:-3], cursor + "x", "", "A" * (MAX_CURSOR_LEN + 1)):
        with pytest.raises(BadRequest):
            decode(broken, listing_digest("a", None, None))
