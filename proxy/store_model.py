"""The session records the store reads and writes, and how Redis replies decode into them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SEP = "\x1f"
STATES = ("active", "protected", "idle", "offloaded")


class StoreDown(Exception):
    """Redis is unreachable; the data plane fails open, admin answers 503."""


class StoreRejected(Exception):
    """A bound refused the hint (max_sessions, max_children, parent_mismatch)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Upserted:
    created: bool
    engine: str | None
    parent_engine: str | None
    last_active: float = 0.0  # before this request: when the prefix was last used or touched
    last_prompt_tokens: int = 0  # before this request


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Session:
    """A session as stored, decoded."""

    tenant: str
    session_id: str
    state: str
    created: float
    last_seen: float
    parent: str | None = None
    agent: str | None = None
    engine: str | None = None
    ttl: float = 0.0
    ttl_until: float = 0.0
    retention: str = "default"
    counters: dict[str, int] = field(default_factory=dict)
    children: tuple[str, ...] = ()
    context_bytes: int = 0
    last_used: float = 0.0
    last_touch: float = 0.0
    last_prompt_tokens: int = 0
    guessed: bool = False  # its protection is kvkeeper's guess (policy/returns.py), not a TTL asked

    @property
    def last_active(self) -> float:
        """When its prefix was last used by a request or refreshed by a touch."""
        return max(self.last_used, self.last_touch, self.last_seen)

    def ttl_left(self, now: float) -> float:
        return max(0.0, self.ttl_until - now)


COUNTERS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "touches",
    "touch_tokens",
    "warmups",
    "warmup_tokens",
    "expiries",
)
# what the retention worker needs of a protected session each tick
BRIEF = (
    "session_id",
    "state",
    "engine",
    "ttl",
    "ttl_until",
    "created",
    "last_seen",
    "last_used",
    "last_touch",
    "parent",
    "last_prompt_tokens",
    "guessed",
)


def decode_session(
    tenant: str, raw: dict[bytes, bytes], children: list[bytes], ctx_len: int
) -> Session:
    d = {k.decode(): v.decode() for k, v in raw.items()}
    return Session(
        tenant=tenant,
        session_id=d["session_id"],
        state=d.get("state", "idle"),
        created=float(d.get("created", 0)),
        last_seen=float(d.get("last_seen", d.get("created", 0))),
        parent=d.get("parent"),
        agent=d.get("agent"),
        engine=d.get("engine") or None,
        ttl=float(d.get("ttl", 0)),
        ttl_until=float(d.get("ttl_until", 0)),
        retention=d.get("retention", "default"),
        counters={k: int(d.get(k, 0)) for k in COUNTERS},
        children=tuple(sorted(c.decode() for c in children)),
        context_bytes=ctx_len,
        last_used=float(d.get("last_used", 0)),
        last_touch=float(d.get("last_touch", 0)),
        last_prompt_tokens=int(d.get("last_prompt_tokens", 0)),
        guessed=d.get("guessed") == "1",
    )


def brief_session(row: Sequence[Any]) -> Session:
    """A session from ``protected.lua``'s row: tenant, then the ``BRIEF`` fields in order."""
    tenant, sid, state, engine, ttl, ttl_until, created, seen, used, touch, parent, lpt, g = row
    return Session(
        tenant=tenant.decode(),
        session_id=sid.decode(),
        state=state.decode() if state else "idle",
        created=float(created or 0),
        last_seen=float(seen or created or 0),
        parent=parent.decode() if parent else None,
        engine=engine.decode() if engine else None,
        ttl=float(ttl or 0),
        ttl_until=float(ttl_until or 0),
        last_used=float(used or 0),
        last_touch=float(touch or 0),
        last_prompt_tokens=int(lpt or 0),
        guessed=g == b"1",
    )


def as_text(value: Any) -> str:
    """Redis replies are bytes; decode one whatever the client's typing says."""
    return value.decode() if isinstance(value, bytes) else str(value)
