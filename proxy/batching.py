"""Auto-pipelining for Lua scripts: calls made while a round trip is under way share the next one.

Under concurrency many handlers upsert sessions at once; sending each EVALSHA separately costs a
syscall pair and a parse per call. The batcher queues calls and sends them as one pipeline on
its own Redis connection, one pipeline at a time: calls made in the same event-loop turn, or
while the previous pipeline waits for Redis, go out together (the technique of ioredis'
``enableAutoPipelining``). A lone call goes out on the next loop turn, so it gains no latency.

The commands are packed here (RESP, a few lines) and written on a redis-py connection whose
parser reads the replies: redis-py's generic ``Pipeline`` spends more CPU per command than the
scripts themselves spend in Redis. Scripts are loaded once and re-loaded when Redis answers
NOSCRIPT (a restarted Redis forgets them). Any connection failure fails the batch in flight
(the store turns it into ``StoreDown``) and the next batch reconnects.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

Arg = bytes | str | int | float
# a queued call: script name, its packed numkeys + keys + args, the caller's future
_Call = tuple[str, int, bytes, "asyncio.Future[Any]"]


def _bulk(value: Arg) -> bytes:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    elif isinstance(value, int):
        data = b"%d" % value
    else:
        data = repr(value).encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _text_bulk(value: Arg) -> str:
    """An int, float or str subclass as one RESP bulk string, in text (its length counted in
    characters: the caller keeps the result only when all of it is ASCII)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = repr(value)
    else:  # int (bool too, as 0/1, like _bulk)
        text = str(int(value))
    return f"${len(text)}\r\n{text}\r\n"


def pack_values(items: Sequence[Arg]) -> bytes:
    """Values as RESP bulk strings, one after the other."""
    if bytes not in map(type, items):  # in C: no generator step per value
        return _pack_text(items)
    # bytes (context blobs among a completion's numbers and ids) as they are, the text
    # between them packed together
    parts: list[bytes] = []
    start = 0
    for i, v in enumerate(items):
        if type(v) is bytes:
            if i > start:
                parts.append(_pack_text(items[start:i]))
            parts.append(b"$%d\r\n%b\r\n" % (len(v), v))
            start = i + 1
    if start < len(items):
        parts.append(_pack_text(items[start:]))
    return b"".join(parts)


def _pack_text(items: Sequence[Arg]) -> bytes:
    """Values that are not bytes: in one join and one encode, twice as fast as packing each
    value (ids, keys, numbers); text that is not ASCII takes the general path."""
    text = "".join([f"${len(v)}\r\n{v}\r\n" if type(v) is str else _text_bulk(v) for v in items])
    if text.isascii():
        return text.encode()
    return b"".join([_bulk(v) for v in items])


def pack_tail(keys: Sequence[Arg], args: Sequence[Arg]) -> tuple[int, bytes]:
    """numkeys, keys and args as RESP bulk strings: (how many, bytes)."""
    items = [len(keys), *keys, *args]
    return len(items), pack_values(items)


def pack_command(head: bytes, n_head: int, keys: Sequence[Arg], args: Sequence[Arg]) -> bytes:
    """One RESP array: ``head`` (``n_head`` packed bulk strings), numkeys, keys, args."""
    n, tail = pack_tail(keys, args)
    return b"*%d\r\n%b%b" % (n_head + n, head, tail)


class ScriptBatcher:
    """Queues ``call(script, keys, args)``; one pipeline of queued calls in flight at a time."""

    def __init__(self, redis: Redis, scripts: Mapping[str, str], *, max_batch: int = 512) -> None:
        self.redis = redis
        self._source = dict(scripts)
        self._head: dict[str, bytes] = {}
        for name, src in scripts.items():
            self._set_sha(name, hashlib.sha1(src.encode()).hexdigest())
        self._max_batch = max_batch
        self._pending: list[_Call] = []
        self._draining = False
        self._task: asyncio.Task[None] | None = None
        self._conn: AbstractConnection | None = None
        self.batches = 0  # for tests and metrics: how many round trips were made
        self.calls = 0

    def _set_sha(self, name: str, sha: str | bytes) -> None:
        self._head[name] = _bulk("EVALSHA") + _bulk(sha)

    async def call(self, script: str, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        # packed here, in the caller: arguments that cannot be packed (text with a lone
        # surrogate) fail this call alone, never the batch it would have joined
        n, tail = pack_tail(keys, args)
        return await self.submit(script, n, tail)

    def submit(self, script: str, n: int, tail: bytes) -> asyncio.Future[Any]:
        """Queue a call already packed (``n`` items: numkeys, keys, args); its reply's future."""
        if script not in self._head:
            raise KeyError(f"unknown script {script!r}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, n, tail, fut))
        if len(self._pending) == 1 and not self._draining:
            loop.call_soon(self._start)
        return fut

    def _start(self) -> None:
        if self._draining or not self._pending:
            return
        self._draining = True
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                await self._run(batch)
        finally:
            self._draining = False

    async def _run(self, batch: list[_Call]) -> None:
        try:
            results = await self._execute(batch)
            missing = [
                i for i, r in enumerate(results) if isinstance(r, redis_errors.NoScriptError)
            ]
            if missing:  # load the scripts, then run again only the calls that did not run
                await self._load_scripts()
                again = await self._execute([batch[i] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except BaseException as exc:  # cancelled too: the callers must not wait forever
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError())
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, fut), result in zip(batch, results, strict=True):
            if fut.done():  # the caller went away
                continue
            if isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    @property
    def connected(self) -> bool:
        """Whether the batcher's connection is open and Redis has not closed it (its end of
        the socket read: a stopped or killed Redis closes it)."""
        conn = self._conn
        reader = getattr(conn, "_reader", None)
        return conn is not None and conn.is_connected and reader is not None and not reader.at_eof()

    async def _connection(self) -> tuple[AbstractConnection, bool]:
        """The batcher's connection, and whether it was opened just now."""
        if self._conn is not None and self._conn.is_connected:
            return self._conn, False
        conn = self.redis.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        await conn.connect()
        self._conn = conn
        return conn, True

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        self.batches += 1
        self.calls += len(batch)
        data = b"".join(b"*%d\r\n%b%b" % (2 + n, self._head[s], tail) for s, n, tail, _ in batch)
        while True:
            conn, fresh = await self._connection()
            results: list[Any] = []
            try:
                await conn.send_packed_command(data, check_health=False)
                for _ in batch:
                    try:
                        results.append(await conn.read_response())
                    except redis_errors.ResponseError as exc:  # this script's, not the link's
                        results.append(exc)
                return results
            except redis_errors.ConnectionError:
                await conn.disconnect(nowait=True)
                # a connection that went stale while idle (Redis restarted, idle timeout) fails
                # before any reply: nothing ran, so the batch is sent once more on a new one
                if fresh or results:
                    raise
            except BaseException:
                await conn.disconnect(nowait=True)  # replies may be left unread: never reuse it
                raise

    async def _load_scripts(self) -> None:
        """SCRIPT LOAD every script, on the batcher's own connection."""
        names = list(self._source)
        data = b"".join(
            b"*3\r\n" + _bulk("SCRIPT") + _bulk("LOAD") + _bulk(self._source[n]) for n in names
        )
        conn, _ = await self._connection()
        try:
            await conn.send_packed_command(data, check_health=False)
            for name in names:
                self._set_sha(name, await conn.read_response())
        except BaseException:
            await conn.disconnect(nowait=True)
            raise

    async def aclose(self) -> None:
        if self._conn is not None:
            await self._conn.disconnect()
            self._conn = None


class ClusterScripts:
    """``call(script, keys, args)`` on a Redis Cluster: each call an EVALSHA routed by its keys'
    slot (every script's keys share one, by their hash tags); scripts are loaded on every
    primary when a node answers NOSCRIPT. Arguments are checked in the caller, as the
    batcher does, so one call's bad text fails only that call."""

    def __init__(self, redis: Any, scripts: Mapping[str, str]) -> None:
        self.redis = redis
        self._source = dict(scripts)
        self._sha = {n: hashlib.sha1(src.encode()).hexdigest() for n, src in scripts.items()}
        self.batches = 0
        self.calls = 0

    async def call(self, script: str, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        sha = self._sha[script]
        pack_tail(keys, args)  # raises here for arguments Redis could not be sent
        self.calls += 1
        self.batches += 1
        try:
            return await self.redis.evalsha(sha, len(keys), *keys, *args)
        except redis_errors.NoScriptError:
            await self.redis.script_load(self._source[script])  # on every primary
            return await self.redis.evalsha(sha, len(keys), *keys, *args)

    async def aclose(self) -> None:
        return None
