"""Ledgers beside the sessions: the offload tier's pins, long-retention pins, and leases."""

from __future__ import annotations

import json
from array import array
from typing import Any

from proxy.store_base import StoreBase
from proxy.store_model import SEP, as_text

# claim a long-retention pin (proxy/longterm.py): KEYS deadlines, pins; ARGV member, before|''
_CLAIM_LONG_PIN = """
local due = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not due then return false end
if ARGV[2] ~= '' and tonumber(due) > tonumber(ARGV[2]) then return false end
local payload = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return payload or false
"""


def pack_pin(head: dict[str, Any], tokens: list[int]) -> bytes:
    """A pin record as the ledgers store it: a JSON header line, then the tokens as uint32."""
    return json.dumps(head).encode() + b"\n" + array("I", tokens).tobytes()


def unpack_pin(raw: bytes) -> tuple[dict[str, Any], list[int]]:
    """The header and tokens :func:`pack_pin` wrote; ValueError for a record it cannot read."""
    head, _, body = raw.partition(b"\n")
    meta = json.loads(head)
    if not isinstance(meta, dict):
        raise ValueError("a pin header is a JSON object")
    tokens = array("I")
    tokens.frombytes(body[: len(body) - len(body) % tokens.itemsize])
    return meta, tokens.tolist()


class PinLedger(StoreBase):
    """Pins kvkeeper holds on engines' tiers (what a next leader must undo) and fenced leases."""

    # --- the offload tier's pin ledger (proxy/tiers.py) ----------------------------------------
    def tier_pins_key(self, engine: str) -> str:
        return f"{self.ns}:tierpins:{engine}"

    async def save_tier_pin(self, engine: str, tenant: str, sid: str, payload: bytes) -> None:
        """Record a pin kvkeeper holds on ``engine``'s tier (what the next leader must undo)."""
        key, member = self.tier_pins_key(engine), self._member(tenant, sid)
        await self._call(lambda: self.redis.hset(key, member, payload))

    async def drop_tier_pin(self, engine: str, tenant: str, sid: str) -> None:
        key, member = self.tier_pins_key(engine), self._member(tenant, sid)
        await self._call(lambda: self.redis.hdel(key, member))

    async def tier_pins(self, engine: str) -> dict[tuple[str, str], bytes]:
        """Every pin recorded on ``engine``'s tier, by (tenant, session id)."""
        key = self.tier_pins_key(engine)
        raw = await self._call(lambda: self.redis.hgetall(key))
        out: dict[tuple[str, str], bytes] = {}
        for member, payload in raw.items():  # bytes: the client does not decode responses
            tenant, _, sid = as_text(member).partition(SEP)
            out[(tenant, sid)] = payload if isinstance(payload, bytes) else payload.encode()
        return out

    # --- retention beyond the GPU cap, pinned in the offload tier (proxy/longterm.py) ----------
    @property
    def long_deadlines_key(self) -> str:
        return f"{self.ns}:long:dl" + (":{long}" if self.cluster else "")

    @property
    def long_pins_key(self) -> str:
        return f"{self.ns}:long:pins" + (":{long}" if self.cluster else "")

    async def save_long_pin(self, tenant: str, sid: str, until: float, payload: bytes) -> None:
        """Record a long-retention pin and its deadline (replacing the session's previous one)."""
        member = self._member(tenant, sid)

        async def op() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self.long_pins_key, member, payload)
                pipe.zadd(self.long_deadlines_key, {member: until})
                await pipe.execute()

        await self._call(op)

    async def long_pin(self, tenant: str, sid: str) -> tuple[float, bytes] | None:
        """(deadline, payload) of the session's long-retention pin, if it has one."""
        member = self._member(tenant, sid)

        async def op() -> tuple[float, bytes] | None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zscore(self.long_deadlines_key, member)
                pipe.hget(self.long_pins_key, member)
                until, payload = await pipe.execute()
            if until is None or payload is None:
                return None
            return float(until), payload if isinstance(payload, bytes) else payload.encode()

        return await self._call(op)

    async def long_held(self, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of these (tenant, sid) have a long-retention pin (one call for all)."""
        if not keys:
            return set()
        members = [self._member(t, s) for t, s in keys]
        scores = await self._call(lambda: self.redis.zmscore(self.long_deadlines_key, members))
        return {k for k, score in zip(keys, scores, strict=True) if score is not None}

    async def long_pins_due(self, now: float, limit: int = 256) -> list[tuple[str, str]]:
        """(tenant, sid) of long-retention pins whose deadline has passed."""
        raw = await self._call(
            lambda: self.redis.zrangebyscore(
                self.long_deadlines_key, "-inf", now, start=0, num=limit
            )
        )
        pairs = (as_text(m).split(SEP, 1) for m in raw)
        return [(p[0], p[1]) for p in pairs if len(p) == 2]

    async def claim_long_pin(
        self, tenant: str, sid: str, before: float | None = None
    ) -> bytes | None:
        """Take the session's long-retention pin off the ledger (with ``before``: only if its
        deadline has passed by then); its payload when this call took it, so exactly one
        replica releases each pin."""
        keys = [self.long_deadlines_key, self.long_pins_key]
        args = [self._member(tenant, sid), "" if before is None else repr(before)]
        raw = await self._call(lambda: self.redis.eval(_CLAIM_LONG_PIN, 2, *keys, *args))
        if not raw:
            return None
        return raw if isinstance(raw, bytes) else str(raw).encode()

    async def lease(self, name: str, holder: str, ttl_ms: int) -> int:
        """Acquire/renew the lease ``name``: the fencing token while held, else 0."""
        tag = f"{{{name}}}" if self.cluster else name  # both keys in one slot
        keys = [f"{self.ns}:lease:{tag}", f"{self.ns}:fence:{tag}"]
        args: list[str | int] = [holder, ttl_ms]
        return int(await self._call(lambda: self.scripts.call("lease", keys, args)))

    async def release_lease(self, name: str, holder: str) -> None:
        key = f"{self.ns}:lease:" + (f"{{{name}}}" if self.cluster else name)
        current = await self._call(lambda: self.redis.get(key))
        if current is not None and as_text(current).rsplit("|", 1)[0] == holder:
            await self._call(lambda: self.redis.delete(key))
