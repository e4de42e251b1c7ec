"""The opaque cursor of ``GET /admin/sessions``: a keyset position, not an offset.

A listing runs over tenants by name, then each tenant's sessions by id; a cursor names the tenant
to resume in and the last session id already examined there ("" = from its start). Ids do not
move when a session is used, so paging while sessions are busy neither skips nor repeats one.
The cursor also carries a digest of the listing it came from (tenant scope and filters): using
it with another listing, or altering it, is a 400, never a silently wrong page.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import NamedTuple

from proxy.errors import BadRequest

MAX_CURSOR_LEN = 4096
_VERSION = 1


class Position(NamedTuple):
    tenant: str  # resume in this tenant (a later one when it has gone)
    after: str  # after this session id; "" = from the tenant's first session


def listing_digest(scope: str | None, parent: str | None, state: str | None) -> str:
    """Which listing a cursor belongs to: tenant scope (None = every tenant) and filters."""
    key = json.dumps([scope, parent, state], separators=(",", ":"))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def encode(position: Position, digest: str) -> str:
    raw = json.dumps([_VERSION, position.tenant, position.after, digest], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode(cursor: str, digest: str) -> Position:
    """The position ``cursor`` names; 400 (param ``cursor``) when it is malformed or was made
    for another listing."""
    if len(cursor) > MAX_CURSOR_LEN:
        raise BadRequest("cursor is malformed", param="cursor")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        fields = json.loads(raw.decode())
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise BadRequest("cursor is malformed", param="cursor") from None
    if (
        not isinstance(fields, list)
        or len(fields) != 4
        or type(fields[0]) is not int
        or fields[0] != _VERSION
        or not all(isinstance(f, str) for f in fields[1:])
    ):
        raise BadRequest("cursor is malformed", param="cursor")
    if fields[3] != digest:
        raise BadRequest(
            "cursor belongs to another listing (other tenant or filters)", param="cursor"
        )
    return Position(fields[1], fields[2])
