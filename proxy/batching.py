"""Auto-pipelining for Lua scripts: calls made in the same event-loop turn share one round trip.

Under concurrency many handlers upsert sessions at once; sending each EVALSHA separately costs a
syscall pair and a parse per call. The batcher queues calls and flushes them on the next loop
turn as one non-transactional pipeline (the technique of ioredis' ``enableAutoPipelining``).
A lone call still goes out on the next turn, so it gains no latency. Scripts are loaded once
and re-loaded when Redis answers NOSCRIPT (a restarted Redis forgets them).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis

Arg = bytes | str | int | float


class ScriptBatcher:
    """Queues ``call(script, keys, args)`` and flushes the queue once per event-loop turn."""

    def __init__(self, redis: Redis, scripts: Mapping[str, str], *, max_batch: int = 512) -> None:
        self.redis = redis
        self._source = dict(scripts)
        self._sha = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in scripts.items()}
        self._max_batch = max_batch
        self._pending: list[tuple[str, Sequence[Arg], Sequence[Arg], asyncio.Future[Any]]] = []
        self._flushing: set[asyncio.Task[None]] = set()
        self.batches = 0  # for tests and metrics: how many round trips were made
        self.calls = 0

    async def call(self, script: str, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((script, keys, args, fut))
        if len(self._pending) >= self._max_batch:
            self._flush()
        return await fut

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _run(
        self, batch: list[tuple[str, Sequence[Arg], Sequence[Arg], asyncio.Future[Any]]]
    ) -> None:
        try:
            results = await self._execute(batch)
            if any(isinstance(r, redis_errors.NoScriptError) for r in results):
                await self._load_scripts()
                results = await self._execute(batch)
        except Exception as exc:
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (*_, fut), result in zip(batch, results, strict=True):
            if fut.done():  # the caller went away
                continue
            if isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    async def _execute(
        self, batch: list[tuple[str, Sequence[Arg], Sequence[Arg], asyncio.Future[Any]]]
    ) -> list[Any]:
        self.batches += 1
        self.calls += len(batch)
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in batch:
                pipe.execute_command("EVALSHA", self._sha[script], len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    async def _load_scripts(self) -> None:
        for name, src in self._source.items():
            self._sha[name] = await self.redis.script_load(src)
