#!/usr/bin/env python3
"""What the retention worker's read of the protected sessions costs Redis, per tick.

    python scripts/bench_retention_scan.py                    # 10K and 20K protected sessions
    python scripts/bench_retention_scan.py --sessions 20000 --changed 0.01 --ticks 10

A private Redis holds N protected sessions of several tenants. Side by side, tick by tick:
``full`` reads every protected session in one script call (what each retention tick did before
issue 29: ``protected.lua`` over the whole deadline set), ``feed`` is ``SessionStore.protected``
now (a mirror loaded once, then only the sessions changed since the last tick, ``feed.lua``).
Before each tick a share of the sessions (``--changed``) has its protection renewed. Reported
per tick: the Redis time of the read (commandstats usec of EVALSHA, the read alone), and the
wall time of the call in this process. Writes ``results/retention_scan.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from loadgen.stack import start_redis
from proxy.hint_model import Hint
from proxy.settings import Limits
from proxy.store import BRIEF, SessionStore


async def _evalsha_usec(redis: Redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("usec", 0))


async def _measure(url: str, n: int, changed: float, ticks: int) -> dict[str, Any]:
    redis = Redis.from_url(url)
    store = SessionStore(redis, Limits(max_sessions_per_tenant=100_000), namespace=f"b{n}")
    tenants = [f"t{i}" for i in range(8)]
    now = time.time()
    for start in range(0, n, 1000):
        await asyncio.gather(
            *(
                store.upsert(tenants[i % 8], Hint(session_id=f"s{i}", ttl_s=3600), now)
                for i in range(start, min(n, start + 1000))
            )
        )
    started = time.perf_counter()
    assert len(await store.protected(time.time())) == n
    load_ms = (time.perf_counter() - started) * 1000
    rows: dict[str, list[tuple[float, float]]] = {"full": [], "feed": []}
    k = int(n * changed)
    for tick in range(ticks):
        for i in range(k):  # a share of the sessions renewed since the last tick
            j = (tick * k + i) % n
            await store.protect(tenants[j % 8], f"s{j}", time.time(), 3600)
        for name in ("full", "feed") if tick % 2 == 0 else ("feed", "full"):
            usec = await _evalsha_usec(redis)
            t0 = time.perf_counter()
            if name == "full":
                args: list[str | int] = [repr(time.time()), 100_000, store.ns, 0, "0", *BRIEF]
                got = len(await store.scripts.call("protected", [store.deadlines_key], args))
                assert got == n * (1 + len(BRIEF))
            else:
                assert len(await store.protected(time.time())) == n
            wall = (time.perf_counter() - t0) * 1000
            rows[name].append(((await _evalsha_usec(redis) - usec) / 1000, wall))
    await store.aclose()
    await redis.aclose()
    out: dict[str, Any] = {"sessions": n, "changed_per_tick": k, "mirror_load_ms": load_ms}
    for name, vals in rows.items():
        out[name] = {
            "redis_ms_median": statistics.median(v[0] for v in vals),
            "wall_ms_median": statistics.median(v[1] for v in vals),
        }
    return out


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as logs:
        async with start_redis(Path(logs)) as url:
            for n in args.sessions:
                r = await _measure(url, n, args.changed, args.ticks)
                results.append(r)
                print(
                    f"{n:>6} protected, {r['changed_per_tick']} changed/tick: "
                    f"full read {r['full']['redis_ms_median']:.1f} ms Redis "
                    f"({r['full']['wall_ms_median']:.1f} ms wall) | "
                    f"feed {r['feed']['redis_ms_median']:.2f} ms Redis "
                    f"({r['feed']['wall_ms_median']:.2f} ms wall); "
                    f"first load {r['mirror_load_ms']:.0f} ms",
                    flush=True,
                )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[10_000, 20_000])
    ap.add_argument("--changed", type=float, default=0.01, help="share renewed per tick")
    ap.add_argument("--ticks", type=int, default=10)
    results = asyncio.run(run(ap.parse_args()))
    out = Path("results/retention_scan.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
