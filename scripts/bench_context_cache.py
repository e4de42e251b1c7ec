"""CPU of retention's per-session context work for one long session, without and with the
context cache (issue 28), side by side in one process.

Without: block learning, the tier pin and a touch's exact-prefix path each decode the recorded
context, tokenize it (a token-id prompt: the vLLM adapter's int checks) and the learning and the
touch hash its blocks (vLLM sha256_cbor). With: ``ContextCache`` shared by the three. Three
figures: a context version's first tick (learn + pin + touch) with nothing cached, the same
when the previous version (``--grow`` tokens shorter) was hashed, and each later touch.

    python scripts/bench_context_cache.py --tokens 100000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import cast

import aiohttp

from adapters.vllm import VLLMAdapter
from proxy.context import decode_context, encode_context
from proxy.context_cache import ContextCache
from proxy.engine_state import EngineState
from proxy.keys import SessionKey

ROUTE = "/v1/completions"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--grow", type=int, default=1000, help="tokens a new version adds")
    args = ap.parse_args()
    async with aiohttp.ClientSession() as http:
        adapter = VLLMAdapter("e", "http://127.0.0.1:9", http)
        es = cast(EngineState, SimpleNamespace(name="e", adapter=adapter))
        tokens = [(i * 7919) % 50_000 for i in range(args.tokens)]
        body = {"model": "m", "prompt": tokens, "cache_salt": "s", "max_tokens": 64}
        blob = encode_context(ROUTE, json.dumps(body).encode())
        older = encode_context(ROUTE, json.dumps({**body, "prompt": tokens[: -args.grow]}).encode())
        key = SessionKey("t", "long")

        async def uncached(hash_it: bool, prefix: bool) -> list[int]:
            ctx = decode_context(blob)
            toks = await adapter.tokenize(ROUTE, ctx.prefix_body() if prefix else ctx.body)
            if not hash_it:
                return toks
            chain = await adapter.hash_chain_async(toks, cache_salt=ctx.body.get("cache_salt"))
            return chain.ids

        async def cached(cache: ContextCache, hash_it: bool, prefix: bool) -> list[int]:
            view = await cache.view(key, blob)
            if not hash_it:
                return await cache.tokens(key, view, es, prefix=prefix)
            return await cache.block_ids(key, view, es)

        async def before_tick() -> None:
            await uncached(True, False)  # block learning
            await uncached(False, True)  # tier pin
            await uncached(True, False)  # touch, exact prefix

        async def before_touch() -> None:
            await uncached(True, False)

        shared = ContextCache()

        async def after_tick() -> None:
            shared.forget(key)  # a new context version: nothing cached yet
            await cached(shared, True, False)
            await cached(shared, False, True)
            await cached(shared, True, False)

        async def after_grown_tick() -> None:  # after previous_version (untimed)
            await cached(shared, True, False)
            await cached(shared, False, True)
            await cached(shared, True, False)

        async def previous_version() -> None:
            shared.forget(key)
            view = await shared.view(key, older)
            await shared.block_ids(key, view, es)

        async def after_touch() -> None:
            await cached(shared, True, False)

        ids = await uncached(True, False)
        assert await cached(ContextCache(), True, False) == ids  # the same block ids
        rows: dict[str, list[float]] = {}
        cases: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("tick, before", before_tick),
            ("tick, after", after_tick),
            ("grown tick, before", before_tick),
            ("grown tick, after", after_grown_tick),
            ("later touch, before", before_touch),
            ("later touch, after", after_touch),
        ]
        for _ in range(args.rounds):  # interleaved: load changes hit both alike
            for name, case in cases:
                if name == "grown tick, after":
                    await previous_version()
                started = time.process_time()
                await case()
                rows.setdefault(name, []).append((time.process_time() - started) * 1e3)
        print(f"{args.tokens} tokens, {len(ids)} blocks, {args.rounds} rounds (CPU ms)")
        for name, ms in rows.items():
            print(f"  {name:22s} median {statistics.median(ms):7.1f}  min {min(ms):7.1f}")
        for what in ("tick", "grown tick", "later touch"):
            b = statistics.median(rows[f"{what}, before"])
            a = statistics.median(rows[f"{what}, after"])
            print(f"  {what}: after/before {a / b:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
