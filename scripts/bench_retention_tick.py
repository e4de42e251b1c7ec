#!/usr/bin/env python3
"""What one retention tick costs the proxy's CPU as idle protected sessions grow.

    python scripts/bench_retention_tick.py                          # 1K, 10K, 20K idle
    python scripts/bench_retention_tick.py --trees /path/to/old .   # two trees side by side

A private Redis and the in-process engine (``tests/helpers/memory_engine.py``, a pool large
enough that the soft-TTL budget keeps everyone): N idle protected sessions (just used, not due),
and before each tick ``--due`` new sessions whose last use was 2,000 s ago (due: each tick
touches them). The first tick (loading and learning everyone) is left out. Reported per tick:
the process CPU of ``Retention.tick`` (``time.process_time``) and its wall time, medians.
With ``--trees``, each size runs in each tree in turn (``PYTHONPATH`` = the tree), rounds
alternated. Writes ``results/retention_tick.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROUTE = "/v1/completions"


async def _measure(url: str, n: int, due: int, ticks: int) -> dict[str, Any]:
    from redis.asyncio import Redis

    from adapters.base import CacheConfig
    from proxy.completions import CompletionWriter
    from proxy.engine_state import EngineState
    from proxy.hint_model import Hint
    from proxy.metrics import Metrics
    from proxy.retention import Retention
    from proxy.settings import EngineSpec, Limits, RetentionSettings, TierSettings
    from proxy.store import SessionStore, Usage
    from proxy.tiers import TierKeeper
    from proxy.upstream import Engine
    from tests.helpers.memory_engine import MemoryEngine

    redis = Redis.from_url(url)
    store = SessionStore(redis, Limits(max_sessions_per_tenant=1_000_000), namespace="bt")
    memory = MemoryEngine(name="a", cache=CacheConfig(block_size=4, num_blocks=10_000_000))
    e = Engine(EngineSpec(url="http://a:1", name="a", kind="memory"), memory)
    es, metrics = EngineState(e), Metrics()
    tiers = TierKeeper(store, TierSettings(), metrics)
    retention = Retention(store, [es], RetentionSettings(), metrics, tiers=tiers)
    await es.signals.connect(discover_cache=True)
    es.signals.subscribe()
    # one eviction seen at 600 s: the horizon (touch every 300 s) whatever the pool's size
    es.signals.estimator.observe_eviction(600.0, time.time())
    writer = CompletionWriter(store)
    made = 0

    async def sessions(count: int, age_s: float) -> None:
        nonlocal made
        at = time.time() - age_s
        names = [f"s{i}" for i in range(made, made + count)]
        made += count
        for start in range(0, count, 1000):
            chunk = names[start : start + 1000]
            await asyncio.gather(
                *(store.upsert("t", Hint(session_id=s, ttl_s=3600), at) for s in chunk)
            )
            for s in chunk:
                i = int(s[1:])
                tokens = [i // 50_000 + 1, i % 50_000 + 1, 3, 4, 5, 6, 7, 8]  # two blocks
                body = json.dumps({"prompt": tokens}).encode()
                usage = Usage(prompt_tokens=len(tokens), cached_tokens=0)
                writer.add(
                    "t", s, engine="a", usage=usage, route=ROUTE, body=body,
                    breakpoint=None, block_offset=None, now=at,
                )  # fmt: skip
                memory.serve(tokens)
            await writer.flush()

    await sessions(n, 0.0)
    await retention.tick(es, time.time())  # loads and learns everyone
    cpu, wall = [], []
    for _ in range(ticks):
        touches = len(memory.touches)
        await sessions(due, 2000.0)
        c0, w0 = time.process_time(), time.perf_counter()
        await retention.tick(es, time.time())
        cpu.append((time.process_time() - c0) * 1000)
        wall.append((time.perf_counter() - w0) * 1000)
        for task in retention.touches.tasks():
            await task
        assert len(memory.touches) - touches == min(due, 4), "the due sessions were not touched"
    await writer.close()
    await retention.stop()
    await store.aclose()
    await redis.aclose()
    return {
        "sessions": n,
        "due_per_tick": due,
        "tick_cpu_ms_median": statistics.median(cpu),
        "tick_wall_ms_median": statistics.median(wall),
    }


async def _run_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    from loadgen.stack import start_redis

    out = []
    with tempfile.TemporaryDirectory() as logs:
        async with start_redis(Path(logs)) as url:
            for n in args.sessions:
                out.append(await _measure(url, n, args.due, args.ticks))
    return out


def _in_tree(tree: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--sessions", str(n)]
    cmd += ["--due", str(args.due), "--ticks", str(args.ticks)]
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])[0]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1_000, 10_000, 20_000])
    ap.add_argument("--due", type=int, default=3, help="sessions that come due before a tick")
    ap.add_argument("--ticks", type=int, default=10)
    ap.add_argument("--trees", nargs="+", help="source trees to compare (default: this one)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON only")
    args = ap.parse_args()
    if not args.trees:
        rows = asyncio.run(_run_here(args))
        if args.json:
            print(json.dumps(rows))
            return
    else:
        rows = []
        for r in range(args.rounds):
            for n in args.sessions:
                trees = args.trees if r % 2 == 0 else list(reversed(args.trees))
                for tree in trees:
                    rows.append({"tree": tree, "round": r, **_in_tree(tree, n, args)})
    load = os.getloadavg()[0]
    for row in rows:
        print(
            f"{row.get('tree', '.')} {row['sessions']:>6} idle, {row['due_per_tick']} due/tick: "
            f"tick CPU {row['tick_cpu_ms_median']:.2f} ms, wall {row['tick_wall_ms_median']:.2f} ms"
            f" (load {load:.1f})",
            flush=True,
        )
    out = Path("results/retention_tick.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
