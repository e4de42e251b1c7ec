#!/usr/bin/env python3
"""TTFT the proxy hop adds, paired request by request, on CacheScout's engine setting.

One simulator (``h100-llama8b``, 151 blocks of 16 tokens, KV events on, as
``bench compare --workload cachescout`` runs it) behind every target at once:

* ``direct``: the client straight to the simulator;
* ``floor``: the barest streaming pass-through the mandated stack allows (``loadgen.floor``:
  aiohttp on uvloop, the body posted upstream and the answer's chunks relayed as they come);
* ``none``: ``kvkeeper serve`` with its defaults (its own Redis, KV events, retention), no hints;
* ``hinted``: another such kvkeeper, each request with an ``agent_hint`` session (and a TTL).

Each round sends one streamed chat request to every target, in a shuffled order, one at a
time (``--concurrency`` > 1 runs that many such streams side by side), each with a prompt the
engine has not seen (a full prefill every time, so targets differ only by what is in front of
the engine). TTFT is the client's: request sent to the first content token, as the benchmarks
measure it. Prints mean / median / p90 per target and the added time over ``direct``, and the
proxies' CPU time per request from /proc.

    python scripts/bench_hop.py [--rounds 150] [--concurrency 1] [--prompt-tokens 1200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.sim.server import SimConfig  # noqa: E402
from loadgen.stack import start_floor, start_kvkeeper, start_redis, start_sims  # noqa: E402

WORDS = ("tool", "call", "result", "agent", "file", "search", "edit", "plan", "test", "run")


def prompt(rng: random.Random, tokens: int) -> list[dict[str, str]]:
    """A chat prompt of about ``tokens`` words nobody sent before."""
    text = " ".join(f"{rng.choice(WORDS)}{rng.randrange(10**6)}" for _ in range(tokens // 3))
    return [{"role": "system", "content": text[: len(text) // 2]},
            {"role": "user", "content": text[len(text) // 2:]}]  # fmt: skip


def cpu_s(pid: int, which: slice = slice(11, 13)) -> float:
    """CPU seconds of ``pid`` (user + system; ``which`` picks the /proc/PID/stat fields)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[which]) / os.sysconf("SC_CLK_TCK")


async def one(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> float | None:
    t0 = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
        ttft = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or ():
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
    return ttft


async def stream_rounds(
    http: aiohttp.ClientSession,
    targets: dict[str, str],
    rounds: int,
    args: argparse.Namespace,
    seed: int,
    out: dict[str, list[float]],
) -> None:
    rng = random.Random(seed)
    for r in range(rounds):
        names = list(targets)
        rng.shuffle(names)
        for name in names:
            body: dict[str, Any] = {
                "model": "sim",
                "messages": prompt(rng, args.prompt_tokens),
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            if name == "hinted":
                body["agent_hint"] = {
                    "session_id": f"s{seed}-{r % 8}",
                    "cache_control": {"type": "ephemeral", "ttl": 5.0},
                }
            ttft = await one(http, targets[name], body, {})
            if ttft is not None:
                out[name].append(ttft)
            await asyncio.sleep(args.pause)


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def _variant(spec: str) -> tuple[str, str | None, dict[str, Any]]:
    """``NAME[:KEY=JSON,...][@TREE]`` -> (name, tree, retention settings)."""
    spec, _, tree = spec.partition("@")
    name, _, items = spec.partition(":")
    pairs = (item.split("=", 1) for item in items.split(",") if item)
    return name, tree or None, {k: json.loads(v) for k, v in pairs}


@contextlib.contextmanager
def _pythonpath(tree: str | None) -> Any:
    """Children started inside run ``tree``'s code (PYTHONPATH; None: this tree's)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = tree or str(ROOT)
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


async def main(args: argparse.Namespace) -> None:
    logs = ROOT / "results" / "bench_hop" / "logs"
    sim = SimConfig(profile="h100-llama8b", num_blocks=151, block_size=16)
    kinds = {"direct": "direct", "floor": "floor", "none": "kvkeeper", "hinted": "kvkeeper"}
    variants: dict[str, tuple[str | None, dict[str, Any]]] = {
        "none": (None, {}),
        "hinted": (None, {}),
    }
    for spec in args.variant:  # more kvkeeper targets: settings of their own, another tree
        name, tree, settings = _variant(spec)
        kinds[name], variants[name] = "kvkeeper", (tree, settings)
    for skip in args.skip:
        kinds.pop(skip, None)
    targets: dict[str, str] = {}
    pids: dict[str, int] = {}
    async with contextlib.AsyncExitStack() as stack:
        for name, kind in kinds.items():  # each target its own simulator (and KV events)
            sims = await stack.enter_async_context(start_sims(sim, 1))
            if kind == "direct":
                targets[name] = sims[0].url
            elif kind == "floor":
                targets[name] = await stack.enter_async_context(start_floor(sims[0].url, logs))
            else:
                tree, settings = variants[name]
                redis_url = await stack.enter_async_context(start_redis(logs))  # its own
                with _pythonpath(tree):
                    targets[name] = await stack.enter_async_context(
                        start_kvkeeper(
                            sims, redis_url, logs, retention={"block_size": 16, **settings}
                        )
                    )
            if kind != "direct" and (pid := _pid_on(targets[name])) is not None:
                pids[name] = pid
        ttfts: dict[str, list[float]] = {n: [] for n in targets}
        connector = aiohttp.TCPConnector(limit=64)
        async with aiohttp.ClientSession(connector=connector) as http:
            warm: dict[str, list[float]] = {n: [] for n in targets}
            await stream_rounds(http, targets, 5, args, 999, warm)
            cpu0 = {k: cpu_s(p) for k, p in pids.items()}
            await asyncio.sleep(args.idle)  # background work alone (ticks, scrapes)
            idle = {k: cpu_s(p) - cpu0[k] for k, p in pids.items()}
            cpu0 = {k: cpu_s(p) for k, p in pids.items()}
            load0 = os.getloadavg()[0]
            await asyncio.gather(
                *(
                    stream_rounds(http, targets, args.rounds, args, args.seed + c, ttfts)
                    for c in range(args.concurrency)
                )
            )
            load1 = os.getloadavg()[0]
            cpu1 = {k: cpu_s(p) for k, p in pids.items()}
    n_req = args.rounds * args.concurrency
    raw = ROOT / "results" / "bench_hop" / "ttft.json"
    raw.write_text(json.dumps({"args": vars(args), "ttft_s": ttfts}))
    direct = ttfts.get("direct") or [0.0]
    print(f"load average {load0:.1f} -> {load1:.1f}; {n_req} requests per target")
    print("| target | mean ms | median ms | p90 ms | mean added ms | p90 added ms | CPU ms/req |")
    print("|---|---|---|---|---|---|---|")
    for name, xs in ttfts.items():
        m, md, q = statistics.fmean(xs), statistics.median(xs), p90(xs)
        dm, dq = m - statistics.fmean(direct), q - p90(direct)
        cpu = f"{(cpu1[name] - cpu0[name]) / n_req * 1e3:.1f}" if name in pids else ""
        print(f"| {name} | {m * 1e3:.2f} | {md * 1e3:.2f} | {q * 1e3:.2f} | "
              f"{dm * 1e3:+.2f} | {dq * 1e3:+.2f} | {cpu} |")  # fmt: skip
    for name in pids:
        print(f"{name} idle CPU: {idle[name] / max(args.idle, 1e-9) * 1e3:.1f} ms/s")


def _pid_on(url: str) -> int | None:
    """The pid listening on ``url``'s port (the kvkeeper child), from /proc/net/tcp."""
    port = int(url.rsplit(":", 1)[1])
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if int(cols[1].split(":")[1], 16) == port and cols[3] == "0A":
            inode = cols[9]
            break
    if inode is None:
        return None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
    return None


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--pause", type=float, default=0.02, help="seconds between requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of no traffic measured")
    ap.add_argument("--skip", action="append", default=[], help="leave a target out")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME[:KEY=JSON,...][@TREE]",
        help="one more unhinted kvkeeper target with these retention settings, run from the "
        "code in TREE (a checkout's root) when @TREE is given",
    )
    asyncio.run(main(ap.parse_args()))
