"""The session plane's hot-path writes: upserts and completion records, batched per script call.

A mixin of :class:`proxy.store.SessionStore`; key layout and failure handling are ``store_base``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from proxy.batching import ScriptBatcher, pack_values
from proxy.hint_model import Hint
from proxy.store_base import StoreBase
from proxy.store_model import SEP, StoreRejected, Upserted, Usage, as_text

# a session's upsert packed but for its time, stale cutoff and request count: (keys, arguments)
Template = tuple[bytes, bytes]
UPSERT_KEYS, UPSERT_ARGS = 10, 13  # per session (lua/upsert.lua)
UPSERTS_PER_CALL = 128  # sessions per script call: Redis runs one call at a time
PACKED_SESSIONS = 100_000  # sessions whose completion keys stay packed (then all are dropped)
_BRIEF = pack_values(("1",))  # upsert.lua: one argument past the sessions' asks for brief replies


class SessionWrites(StoreBase):
    """Create/refresh sessions and record completions: the writes every hinted request makes."""

    def _setup(self) -> None:
        super()._setup()
        self._packed: dict[tuple[str, str], tuple[bytes, bytes]] = {}
        self._engines_packed: dict[str, bytes] = {}

    # --- hot path -----------------------------------------------------------------------------
    async def upsert(self, tenant: str, hint: Hint, now: float) -> Upserted:
        """Create or refresh the hint's session (one round trip). Raises StoreRejected/StoreDown."""
        keys, args = self._upsert_call(tenant, hint, now, 1)
        reply = await self._call(lambda: self.scripts.call("upsert", keys, args))
        return await self._upserted(tenant, reply) if self.cluster else _decoded(reply)

    def upsert_template(self, tenant: str, hint: Hint) -> Template:
        """The packed parts of the hint's upsert that its repeats share: (its keys, the
        arguments between the time and the stale cutoff)."""
        keys, args = self._upsert_call(tenant, hint, 0.0, 1)
        return pack_values(keys), pack_values(args[1:11])

    async def upsert_many(
        self, calls: list[tuple[str, Hint, float, int, Template]]
    ) -> list[bool | StoreRejected]:
        """``upsert`` for several (tenant, hint, now, requests it stands for, its template):
        up to ``UPSERTS_PER_CALL`` sessions a script call (on a cluster one each), in one
        pipeline. Whether each created its session, or its rejection in its place (a brief
        reply: what Redis had of the session is not sent back); StoreDown when Redis fails."""
        scripts = self.scripts
        out: list[bool | StoreRejected] = []
        if isinstance(scripts, ScriptBatcher):
            chunks = [
                calls[i : i + UPSERTS_PER_CALL] for i in range(0, len(calls), UPSERTS_PER_CALL)
            ]

            def send() -> Awaitable[list[Any]]:
                return asyncio.gather(*(self._submit_many(scripts, chunk) for chunk in chunks))

            for answer in await self._call(send):
                for reply in answer:  # 1 (created), 0, or the rejection's reason
                    out.append(bool(reply) if type(reply) is int else StoreRejected(as_text(reply)))
            return out
        replies = await self._call(
            lambda: asyncio.gather(
                *(
                    scripts.call("upsert", *self._upsert_call(t, h, now, r))
                    for t, h, now, r, _ in calls
                )
            )
        )
        for (tenant, *_), reply in zip(calls, replies, strict=True):
            try:  # one coroutine per reply only on a cluster (its tenant set)
                up = await self._upserted(tenant, reply) if self.cluster else _decoded(reply)
                out.append(up.created)
            except StoreRejected as exc:
                out.append(exc)
        return out

    def _submit_many(
        self, scripts: ScriptBatcher, chunk: list[tuple[str, Hint, float, int, Template]]
    ) -> asyncio.Future[Any]:
        """One upsert call for the chunk's sessions: every session's keys, then their arguments,
        then the flag asking for brief replies."""
        parts = [pack_values((UPSERT_KEYS * len(chunk),))]
        parts += [keys for *_, (keys, _) in chunk]
        parts += [self._args(tpl, now, requests) for *_, now, requests, tpl in chunk]
        parts.append(_BRIEF)
        return scripts.submit(
            "upsert", 2 + (UPSERT_KEYS + UPSERT_ARGS) * len(chunk), b"".join(parts)
        )

    def _args(self, template: Template, now: float, requests: int) -> bytes:
        """An upsert's packed arguments from its template (as ``_upsert_call``)."""
        # numbers written by bytes formatting (%a: a float's repr), no str() or encode()
        at, stale, n = b"%a" % now, b"%a" % (now - self.limits.idle_expiry_s), b"%d" % requests
        return b"$%d\r\n%b\r\n%b$%d\r\n%b\r\n$%d\r\n%b\r\n" % (
            len(at),
            at,
            template[1],
            len(stale),
            stale,
            len(n),
            n,
        )

    def _tail(self, template: Template, now: float, requests: int) -> bytes:
        """A whole upsert call's numkeys, keys and arguments from its template."""
        return pack_values((UPSERT_KEYS,)) + template[0] + self._args(template, now, requests)

    def _upsert_call(
        self, tenant: str, hint: Hint, now: float, requests: int
    ) -> tuple[list[str], list[str | int]]:
        sid, parent = hint.session_id, hint.parent_session_id or ""
        keys = [
            self.key("s", tenant, sid),
            self.index_key(tenant),
            self.dl_key(tenant),
            self.key("s", tenant, parent) if parent else self._none(tenant),
            self.key("ch", tenant, parent) if parent else self._none(tenant),
            # the tenants SET is one key for all: on a cluster it is added to after the call
            f"{self.ns}:tn:{self._t(tenant)}" if self.cluster else self.tenants_key,
            self.key("ch", tenant, sid),
            self.key("ctx", tenant, sid),
            *self.feed_keys(tenant),
        ]
        args: list[str | int] = [
            repr(now),
            sid,
            tenant,
            parent,
            hint.agent_name or "",
            "" if hint.ttl_s is None else repr(hint.ttl_s),
            hint.retention,
            self.limits.max_sessions_per_tenant,
            self.limits.max_children,
            self.limits.idle_expiry_s,
            f"{tenant}{SEP}{sid}",
            repr(now - self.limits.idle_expiry_s),
            requests,
        ]
        return keys, args

    async def _upserted(self, tenant: str, reply: Any) -> Upserted:
        up = _decoded(reply)  # raises StoreRejected first
        if self.cluster and (up.created or tenant not in self._known_tenants):
            await self._call(lambda: self.redis.sadd(self.tenants_key, tenant))
            self._known_tenants.add(tenant)
        return up

    async def unregister(self, tenant: str, hint: Hint, now: float) -> bool:
        """Undo the session ``upsert`` created for a request that then failed upstream; False
        when another request has used it since (it is kept, and no longer ``active``)."""
        sid, parent = hint.session_id, hint.parent_session_id or ""
        keys = [
            self.key("s", tenant, sid),
            self.index_key(tenant),
            self.dl_key(tenant),
            self.key("ch", tenant, sid),
            self.key("ctx", tenant, sid),
            self.key("ch", tenant, parent) if parent else self._none(tenant),
            *self.feed_keys(tenant),
        ]
        args: list[str | int | float] = [sid, f"{tenant}{SEP}{sid}", now]
        return bool(await self._call(lambda: self.scripts.call("unregister", keys, args)))

    async def record_completions(
        self, records: list[tuple[str, str, float, str, Usage, Usage, bytes]]
    ) -> int:
        """Write finished requests, merged per session, in one script call (off the hot path;
        one per tenant on a cluster, where a call touches one slot).

        A record is (tenant, sid, now, engine, last request's usage, summed usage, context blob
        or b""). Returns how many sessions still existed.
        """
        if not self.cluster:
            return await self._complete(records, self.feed_keys(""))
        by_tenant: dict[str, list[tuple[str, str, float, str, Usage, Usage, bytes]]] = {}
        for record in records:
            by_tenant.setdefault(record[0], []).append(record)
        written = 0
        for tenant, group in by_tenant.items():
            written += await self._complete(group, self.feed_keys(tenant))
        return written

    async def _complete(
        self, records: list[tuple[str, str, float, str, Usage, Usage, bytes]], feed: list[str]
    ) -> int:
        scripts = self.scripts
        if isinstance(scripts, ScriptBatcher):  # packed from each session's cached parts
            n, tail = self._complete_tail(records, feed)
            return int(await self._call(lambda: scripts.submit("complete", n, tail)))
        keys, args = self._complete_call(records, feed)
        return int(await self._call(lambda: scripts.call("complete", keys, args)))

    def _complete_tail(
        self, records: list[tuple[str, str, float, str, Usage, Usage, bytes]], feed: list[str]
    ) -> tuple[int, bytes]:
        """``complete``'s numkeys, keys and arguments, as ``pack_tail(*_complete_call(...))``:
        a session's keys, id and deadline member packed once (``_record_parts``)."""
        keys = [pack_values((len(feed) + 3 * len(records), *feed))]
        args = [pack_values((self.limits.idle_expiry_s,))]
        packed, engines = self._packed, self._engines_packed
        for tenant, sid, now, engine, last, total, context in records:
            parts = packed.get((tenant, sid)) or self._record_parts(tenant, sid)
            keys.append(parts[0])
            # the time and the five counters by bytes formatting (%a: a float's repr)
            at, lp, lc = b"%a" % now, b"%d" % last.prompt_tokens, b"%d" % last.cached_tokens
            tp, tc = b"%d" % total.prompt_tokens, b"%d" % total.cached_tokens
            tt = b"%d" % total.completion_tokens
            args.append(
                b"$%d\r\n%b\r\n%b$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n"
                b"$%d\r\n%b\r\n$%d\r\n%b\r\n%b"
                % (
                    len(at), at,
                    engines.get(engine) or self._engine_bulk(engine),
                    len(lp), lp, len(lc), lc, len(tp), tp, len(tc), tc, len(tt), tt,
                    len(context), context,
                    parts[1],
                )
            )  # fmt: skip
        return 1 + len(feed) + 3 * len(records) + 1 + 10 * len(records), b"".join(keys + args)

    def _record_parts(self, tenant: str, sid: str) -> tuple[bytes, bytes]:
        """A session's completion keys, and its id and deadline member, packed (kept for the
        next records of the same session, up to ``PACKED_SESSIONS``)."""
        parts = self._packed.get((tenant, sid))
        if parts is None:
            if len(self._packed) >= PACKED_SESSIONS:
                self._packed.clear()
            keys = (
                self.key("s", tenant, sid),
                self.key("ctx", tenant, sid),
                self.index_key(tenant),
            )
            parts = pack_values(keys), pack_values((sid, self._member(tenant, sid)))
            self._packed[(tenant, sid)] = parts
        return parts

    def _engine_bulk(self, engine: str) -> bytes:
        packed = self._engines_packed.get(engine)
        if packed is None:
            packed = self._engines_packed[engine] = pack_values((engine,))
        return packed

    def _complete_call(
        self, records: list[tuple[str, str, float, str, Usage, Usage, bytes]], feed: list[str]
    ) -> tuple[list[str], list[bytes | str | int | float]]:
        keys: list[str] = list(feed)
        args: list[bytes | str | int | float] = [self.limits.idle_expiry_s]
        for tenant, sid, now, engine, last, total, context in records:
            keys += [
                self.key("s", tenant, sid),
                self.key("ctx", tenant, sid),
                self.index_key(tenant),
            ]
            args += [
                repr(now),
                engine,
                last.prompt_tokens,
                last.cached_tokens,
                total.prompt_tokens,
                total.cached_tokens,
                total.completion_tokens,
                context,
                sid,
                self._member(tenant, sid),
            ]
        return keys, args

    # --- reads ----------------------------------------------------------------------------------


def _decoded(reply: Any) -> Upserted:
    """An upsert's ``ok`` reply; StoreRejected for its rejection."""
    if reply[0] != b"ok":
        raise StoreRejected(as_text(reply[0]))
    _, created, engine, parent_engine, last_active, last_prompt = reply
    # float() and int() read bytes as they read text
    return Upserted(
        bool(created),
        (engine.decode() if type(engine) is bytes else str(engine)) or None,
        (parent_engine.decode() if type(parent_engine) is bytes else str(parent_engine)) or None,
        float(last_active),
        int(last_prompt),
    )
