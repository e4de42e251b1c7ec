#!/usr/bin/env python3
"""The latency kvkeeper adds to long token-id prompts, the Claude Code traces' size.

    python scripts/bench_long_prompt_overhead.py                 # 100K-token prompts
    python scripts/bench_long_prompt_overhead.py --tokens 20000 --requests 20 --rounds 3

One simulator (``instant`` profile: it answers as soon as it has parsed, hashed and admitted
a prompt, so what is left is the HTTP and bookkeeping path), a private Redis, and kvkeeper in
front with its KV-event subscription, as `bench compare` runs them. Each request is a fresh
random prompt, sent one at a time: straight to the simulator (``direct``), through kvkeeper
without hints, and through kvkeeper with an ``agent_hint`` (session registered in Redis,
context recorded). Each prompt stores its blocks and evicts the previous prompt's, so kvkeeper
also digests a KV-event batch of thousands of block hashes per request, as it does in front
of an engine serving 100K-token agent contexts. Rounds interleave the three paths; the
figure is the median time to the first streamed chunk, and what kvkeeper adds to it, and
kvkeeper's own CPU time per request (from /proc; ``direct`` shows its KV-event work alone),
which a loaded machine moves much less than wall times. Writes
``results/long_prompt_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.sim.server import SimConfig
from loadgen.stack import start_kvkeeper, start_redis, start_sims

PATHS = ("direct", "kvkeeper", "kvkeeper+hint")


def _proxy_pid(url: str) -> int | None:
    """The kvkeeper child serving ``url`` (its config file is named after its port)."""
    name = f"kvkeeper-{url.rsplit(':', 1)[1]}.yaml".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and name in (proc / "cmdline").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    return None


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` so far (0 where /proc cannot tell)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def first_chunk_s(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    data = json.dumps(body).encode()  # encoded before the clock starts: the client's cost
    t0 = time.perf_counter()
    async with http.post(
        url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        if resp.status != 200:
            raise SystemExit(f"{url}: {resp.status} {await resp.text()}")
        async for _ in resp.content:
            return time.perf_counter() - t0
    raise SystemExit(f"{url}: empty stream")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(args.out).parent / "long_prompt_overhead_logs"
    rng = random.Random(args.seed)
    config = SimConfig(
        profile="instant",
        num_blocks=-(-2 * args.tokens // 64) + 16,  # room for two prompts: each evicts the last
        block_size=64,
        max_model_len=max(131_072, args.tokens + 16),
    )
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    cpu: dict[str, float] = dict.fromkeys(PATHS, 0.0)
    async with (
        start_sims(config, 1) as sims,
        start_redis(logs) as redis_url,
        start_kvkeeper(sims, redis_url, logs, retention={"block_size": 64}) as kvkeeper,
        aiohttp.ClientSession() as http,
    ):
        urls = {"direct": sims[0].url, "kvkeeper": kvkeeper, "kvkeeper+hint": kvkeeper}
        pid = _proxy_pid(kvkeeper)
        for r in range(args.rounds):
            for path in PATHS:
                await asyncio.sleep(0.2)  # the previous path's KV events digested
                cpu0 = _cpu_s(pid)
                for i in range(args.requests):
                    body: dict[str, Any] = {
                        "model": "sim",
                        "prompt": [rng.randrange(1000, 30000) for _ in range(args.tokens)],
                        "max_tokens": 1,
                        "stream": True,
                    }
                    if path == "kvkeeper+hint":
                        body["agent_hint"] = {"session_id": f"bench-{r}-{i}"}
                    samples[path].append(await first_chunk_s(http, urls[path], body))
                await asyncio.sleep(0.2)
                cpu[path] += _cpu_s(pid) - cpu0
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    medians = {p: statistics.median(v) for p, v in samples.items()}
    doc = {
        "tokens": args.tokens,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "median_first_chunk_ms": {p: round(1000 * m, 2) for p, m in medians.items()},
        "added_ms": {p: round(1000 * (medians[p] - medians["direct"]), 2) for p in PATHS[1:]},
        # kvkeeper's own CPU per request (its KV-event work included; ``direct`` is that alone):
        # unlike wall times, it holds on a loaded machine
        "proxy_cpu_ms_per_request": {
            p: round(1000 * c / (args.rounds * args.requests), 2) for p, c in cpu.items()
        },
        "samples_ms": {p: [round(1000 * s, 2) for s in v] for p, v in samples.items()},
    }
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=100_000, help="prompt length in tokens")
    p.add_argument("--requests", type=int, default=10, help="requests per path per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="results/long_prompt_overhead.json")
    args = p.parse_args()
    doc = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for path in PATHS:
        added = doc["added_ms"].get(path)
        extra = "" if added is None else f"  (+{added:.1f} ms over direct)"
        cpu_ms = doc["proxy_cpu_ms_per_request"][path]
        print(
            f"{path:14s} median first chunk {doc['median_first_chunk_ms'][path]:.1f} ms{extra}; "
            f"kvkeeper CPU {cpu_ms:.1f} ms/request"
        )


if __name__ == "__main__":
    main()
