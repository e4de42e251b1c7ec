"""The key of a session everywhere in the proxy: its tenant and its id."""

from __future__ import annotations

from typing import NamedTuple


class SessionKey(NamedTuple):
    tenant: str
    session_id: str
