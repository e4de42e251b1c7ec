"""How far the engine simulator scales on this machine.

Runs the simulator as a subprocess (its own event loop; the load generator has this one) and
measures:

1. ``streams``: N concurrent streaming chat sessions (a shared system prompt + a per-session
   part, ``max_tokens`` output each): requests/s, client-side TTFT, failures;
2. ``long``: 100K-token prompts (token ids): a cold one, then ones sharing its prefix with a new
   tail; wall time per request and per 1K prompt tokens simulated.

The simulator uses the ``instant`` profile by default, so the figures are the simulator's own
overhead (what caps a benchmark's speed), not a modelled GPU. Writes JSON to ``results/``.

    python scripts/bench_sim_scale.py --sessions 500 --long-tokens 100000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.sim import SimConfig, run_simulator_process


async def one_stream(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, int, int]:
    """(ttft seconds, completion tokens, cached tokens) of one streamed chat request."""
    body = {"messages": messages, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft = -1.0
    usage: dict[str, Any] = {}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft < 0 and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return ttft, usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def bench_streams(url: str, sessions: int, max_tokens: int) -> dict[str, Any]:
    system = "You are one agent of a swarm. Follow the shared rules. " * 150  # ~1.5K tokens
    jobs = [
        [{"role": "system", "content": system},
         {"role": "user", "content": f"Session {i}: summarise task {i * 7919} in detail."}]
        for i in range(sessions)
    ]  # fmt: skip
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(http, url, m, max_tokens) for m in jobs), return_exceptions=True
        )
        wall = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, tuple)]
    ttfts = sorted(r[0] for r in ok)
    return {
        "sessions": sessions,
        "max_tokens": max_tokens,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 1),
        "output_tokens_per_s": round(sum(r[1] for r in ok) / wall, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p99_s": round(ttfts[int(0.99 * (len(ttfts) - 1))], 3) if ttfts else None,
        "cached_tokens_mean": round(statistics.mean(r[2] for r in ok), 1) if ok else None,
    }


async def bench_long(url: str, tokens: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(1)
    base = [rng.randrange(100, 50_000) for _ in range(tokens)]
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for i in range(repeats + 1):
            prompt = base if i == 0 else base[: tokens - 2000] + [rng.randrange(100, 50_000) for _ in range(2000)]  # fmt: skip
            t0 = time.perf_counter()
            body = {"prompt": prompt, "max_tokens": 1}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                data = await resp.json()
            wall = time.perf_counter() - t0
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            rows.append({"prompt_tokens": len(prompt), "cached_tokens": cached,
                         "wall_s": round(wall, 4),
                         "s_per_1k_prompt_tokens": round(wall / (len(prompt) / 1000), 5)})  # fmt: skip
    return {"tokens": tokens, "requests": rows}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    config = SimConfig(
        profile=args.profile,
        speed=args.speed,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.long_tokens + 4096,
        replay_port=None,
    )
    report: dict[str, Any] = {"config": {k: getattr(config, k) for k in config.__slots__}}
    async with run_simulator_process(config) as sim:
        report["streams"] = await bench_streams(sim.url, args.sessions, args.max_tokens)
        print("streams:", json.dumps(report["streams"]))
        report["long"] = await bench_long(sim.url, args.long_tokens, args.long_repeats)
        print("long:", json.dumps(report["long"]))
    return report


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=100_000)
    p.add_argument("--long-repeats", type=int, default=3)
    p.add_argument("--profile", default="instant")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--num-blocks", type=int, default=60_000)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--out", default="results")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    result = asyncio.run(main(arguments))
    out_dir = Path(arguments.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"sim_scale_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
