#!/usr/bin/env python3
"""What kvkeeper costs on the request path, side by side in one run.

Targets, all in front of the SAME fast upstream (a tiny OpenAI-compatible server that answers
immediately), each in its own process: ``direct`` (no proxy), ``kvkeeper`` unhinted, ``kvkeeper``
hinted (agent_hint session + TTL: a Redis Lua upsert before forwarding, usage + context recorded
after), the Rust ``vllm-router`` (PyPI 0.1.17, ``--policy cache_aware``) when installed, and
``aiohttp-floor``: the barest reverse proxy the mandated stack allows (an aiohttp handler that
reads the body, posts it upstream with one shared aiohttp client and returns the answer, on
uvloop: no hints, headers, metrics or Redis), the floor any aiohttp proxy starts from.

For concurrency 1, 16 and 128 it reports p50/p99 latency added over ``direct``, throughput
relative to ``direct``, and CPU time per request of the proxy process (from /proc, the figure
a noisy shared machine disturbs least). Rounds are interleaved so drift hits all targets alike.

    python scripts/bench_proxy_overhead.py [--requests 2000] [--rounds 3] [--router PATH]

Writes results/proxy_overhead.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "Say hi. " * 40}],
    "max_tokens": 8,
}
ANSWER = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 90,
            "completion_tokens": 1,
            "total_tokens": 91,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }
).encode()


def agent_body(prompt_chars: int) -> dict[str, Any]:
    """BODY behind a shared system prompt of ``prompt_chars`` characters (an agent's anchor:
    instructions and tool definitions, the same on every call), ``BODY`` itself for 0."""
    if prompt_chars <= 0:
        return BODY
    words = ("tool", "call", "result", "agent", "file", "search", "edit", "plan", "test", "run")
    text: list[str] = []
    size = 0
    while size < prompt_chars:
        i = len(text)
        text.append(f"{words[i % len(words)]}{i % 97}")
        size += len(text[-1]) + 1
    system = " ".join(text)[:prompt_chars]
    return {**BODY, "messages": [{"role": "system", "content": system}, *BODY["messages"]]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the upstream (run in its own process with --serve-upstream) -----------------------------
def serve_upstream(port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    _run(app, port)


def _run(app: Any, port: int) -> None:
    """Serve ``app`` on uvloop when installed, quietly (the bench servers' own processes)."""
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_floor(port: int, upstream: str) -> None:
    """The ``aiohttp-floor`` target: forward and answer, nothing else."""
    from aiohttp import web

    client: aiohttp.ClientSession | None = None

    async def forward(request: web.Request) -> web.Response:
        assert client is not None
        body = await request.read()
        async with client.post(
            upstream + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def open_client(app: web.Application) -> Any:
        nonlocal client
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await client.close()

    app = web.Application()
    app.cleanup_ctx.append(open_client)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    _run(app, port)


# --- processes ---------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its live children, from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError):
            pass
    return total


async def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status < 500:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {timeout_s}s")


def spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log = open(ROOT / "results" / f"bench-{Path(cmd[0]).name}-{len(cmd)}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


# --- load ----------------------------------------------------------------------------------------
async def load(
    url: str,
    n: int,
    concurrency: int,
    headers: dict[str, str],
    hinted: bool,
    rate: float | None = None,
    base_body: dict[str, Any] = BODY,
) -> tuple[list[float], float]:
    """``n`` requests from ``concurrency`` clients: back to back (closed loop), or paced so that
    together they offer ``rate`` requests/s (each client on its own fixed schedule)."""
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        queue = iter(range(n))
        start = time.perf_counter()

        async def worker(w: int) -> None:
            for k, i in enumerate(queue):
                if rate is not None:  # client w sends at start + (w + k * concurrency) / rate
                    due = start + (w + k * concurrency) / rate
                    if (wait := due - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                body = base_body
                if hinted:  # a few hundred sessions, each with a TTL, like an agent swarm
                    body = {
                        **base_body,
                        "agent_hint": {
                            "session_id": f"s{(w * 7919 + i) % 500}",
                            "cache_control": {"type": "ephemeral", "ttl": 300},
                        },
                    }
                t0 = time.perf_counter()
                async with s.post(url, json=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}")
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return lat, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--router", default=shutil.which("vllm-router"), help="vllm-router executable")
    ap.add_argument(
        "--paced-rps",
        type=float,
        default=1000.0,
        help="also run c=16 paced at this total rate (latency when the proxy is not saturated)",
    )
    ap.add_argument(
        "--prompt-chars",
        type=int,
        default=0,
        help="put a shared system prompt of this many characters before the user message "
        "(0: the short prompt alone; 16000 is about a 4K-token agent anchor)",
    )
    ap.add_argument(
        "--workers",
        default="1",
        help="kvkeeper targets at these --workers counts, comma-separated (e.g. 1,2)",
    )
    ap.add_argument(
        "--retention-off",
        action="store_true",
        help="add kvkeeper+hints with retention disabled (the request path's share of the cost)",
    )
    ap.add_argument("--no-floor", action="store_true", help="leave out the aiohttp floor target")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "proxy_overhead.json")
    args = ap.parse_args()

    up_port, router_port, redis_port = free_port(), free_port(), free_port()
    floor_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    procs = [spawn([sys.executable, __file__, "--serve-upstream", str(up_port)])]
    floor = spawn([sys.executable, __file__, "--serve-floor", str(floor_port), upstream])
    procs.append(floor)
    redis = spawn(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"])
    procs.append(redis)
    worker_counts = [int(x) for x in args.workers.split(",")]
    targets: dict[str, tuple[str, int | None, bool]] = {"direct": (upstream, None, False)}
    metrics_dirs: dict[int, Path] = {}
    kvk_ports: list[int] = []
    for n in worker_counts:
        port = free_port()
        kvk_ports.append(port)
        env = dict(os.environ)
        if n > 1:  # each worker's counters in files of its own: requests per worker
            metrics_dirs[n] = Path(tempfile.mkdtemp(prefix=f"bench-w{n}-"))
            env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dirs[n])
        kvk = spawn(
            [
                sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
                "--engine", upstream, "--redis", f"redis://127.0.0.1:{redis_port}/0",
                "--log-level", "WARNING", "--workers", str(n),
            ],
            env,
        )  # fmt: skip
        procs.append(kvk)
        tag = "" if n == 1 else f" w{n}"
        targets[f"kvkeeper{tag}"] = (f"http://127.0.0.1:{port}", kvk.pid, False)
        targets[f"kvkeeper+hints{tag}"] = (f"http://127.0.0.1:{port}", kvk.pid, True)
    if args.retention_off:  # the request path alone: hinted, with no retention worker running
        port = free_port()
        kvk_ports.append(port)
        env = {**os.environ, "KVKEEPER_RETENTION__ENABLED": "false"}
        kvk = spawn(
            [
                sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
                "--engine", upstream, "--redis", f"redis://127.0.0.1:{redis_port}/1",
                "--log-level", "WARNING", "--workers", "1",
            ],
            env,
        )  # fmt: skip
        procs.append(kvk)
        targets["kvkeeper+hints noret"] = (f"http://127.0.0.1:{port}", kvk.pid, True)
    if not args.no_floor:
        targets["aiohttp-floor"] = (f"http://127.0.0.1:{floor_port}", floor.pid, False)
    router = None
    if args.router:
        router = spawn(
            [
                args.router,
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--worker-urls",
                upstream,
                "--policy",
                "cache_aware",
                "--log-level",
                "error",
                "--prometheus-port",
                str(free_port()),
            ]
        )
        procs.append(router)
        targets["vllm-router"] = (f"http://127.0.0.1:{router_port}", router.pid, False)
    try:
        await wait_http(upstream + "/health")
        for port in kvk_ports:
            await wait_http(f"http://127.0.0.1:{port}/healthz")
        await wait_http(f"http://127.0.0.1:{floor_port}/health")
        if router:
            await wait_http(f"http://127.0.0.1:{router_port}/health", 120)
        results: dict[str, dict[str, Any]] = {}
        settings: list[tuple[str, int, float | None]] = [
            (x, int(x), None) for x in args.concurrency.split(",")
        ]
        if args.paced_rps:
            settings.append((f"16@{args.paced_rps:g}rps", 16, args.paced_rps))
        body = agent_body(args.prompt_chars)
        for label, c, rate in settings:
            per: dict[str, dict[str, list[float]]] = {
                t: {"lat": [], "rps": [], "cpu": [], "redis_cpu": []} for t in targets
            }
            for url, _, hinted in targets.values():  # warm-up
                await load(url + "/v1/chat/completions", 200, c, {}, hinted, None, body)
            for rnd in range(args.rounds):
                order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
                for name in order:
                    url, pid, hinted = targets[name]
                    cpu0 = cpu_seconds(pid) if pid else 0.0
                    rcpu0 = cpu_seconds(redis.pid)
                    lat, wall = await load(
                        url + "/v1/chat/completions", args.requests, c, {}, hinted, rate, body
                    )
                    cpu1 = cpu_seconds(pid) if pid else 0.0
                    rcpu1 = cpu_seconds(redis.pid)
                    per[name]["lat"] += lat
                    per[name]["rps"].append(len(lat) / wall)
                    per[name]["cpu"].append((cpu1 - cpu0) / len(lat))
                    per[name]["redis_cpu"].append((rcpu1 - rcpu0) / len(lat))
                    print(
                        f"c={label} round {rnd + 1}/{args.rounds} {name}: {statistics.median(lat) * 1e3:.2f} ms p50",
                        file=sys.stderr,
                    )
            base = per["direct"]
            row: dict[str, Any] = {}
            for name, d in per.items():
                row[name] = {
                    "p50_ms": pct(d["lat"], 0.5) * 1e3,
                    "p99_ms": pct(d["lat"], 0.99) * 1e3,
                    "added_p50_ms": (pct(d["lat"], 0.5) - pct(base["lat"], 0.5)) * 1e3,
                    "added_p99_ms": (pct(d["lat"], 0.99) - pct(base["lat"], 0.99)) * 1e3,
                    "rps": statistics.median(d["rps"]),
                    "throughput_vs_direct": statistics.median(d["rps"])
                    / statistics.median(base["rps"]),
                    "cpu_us_per_request": statistics.median(d["cpu"]) * 1e6
                    if name != "direct"
                    else None,
                    "redis_cpu_us_per_request": statistics.median(d["redis_cpu"]) * 1e6
                    if name.startswith("kvkeeper")
                    else None,
                }
            results[label] = row
        for row in results.values():
            row["_ratios"] = ratios(row, worker_counts)
        spread = {n: requests_per_worker(folder) for n, folder in metrics_dirs.items()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "requests": args.requests,
                    "rounds": args.rounds,
                    "prompt_chars": args.prompt_chars,
                    "results": results,
                    "requests_per_worker": spread,
                },
                indent=2,
            )
        )
        print(render(results))
        for n, counts in spread.items():
            print(
                f"workers={n}: requests per worker {counts} (max/min {max(counts) / min(counts):.2f})"
            )
    finally:
        for p in procs:
            stop(p)
        for folder in metrics_dirs.values():
            shutil.rmtree(folder, ignore_errors=True)


def cpu_ratio(row: dict[str, Any], a: str, b: str) -> float | None:
    """CPU per request of target ``a`` over target ``b`` (None when either is missing)."""
    if a not in row or b not in row:
        return None
    return float(row[a]["cpu_us_per_request"] / row[b]["cpu_us_per_request"])


def ratios(row: dict[str, Any], worker_counts: list[int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for n in worker_counts:
        tag = "" if n == 1 else f" w{n}"
        hinted, plain = row[f"kvkeeper+hints{tag}"], row[f"kvkeeper{tag}"]
        key = "" if n == 1 else f"_w{n}"
        out[f"hinted_over_unhinted_added_p50{key}"] = (
            hinted["added_p50_ms"] / plain["added_p50_ms"] if plain["added_p50_ms"] > 0 else None
        )
        out[f"hinted_cpu_over_unhinted_cpu{key}"] = cpu_ratio(
            row, f"kvkeeper+hints{tag}", f"kvkeeper{tag}"
        )
        if n != 1:  # CPU per request at n workers against one
            out[f"unhinted_cpu_w{n}_over_w1"] = cpu_ratio(row, f"kvkeeper{tag}", "kvkeeper")
            out[f"hinted_cpu_w{n}_over_w1"] = cpu_ratio(
                row, f"kvkeeper+hints{tag}", "kvkeeper+hints"
            )
    first = "" if 1 in worker_counts else f" w{worker_counts[0]}"
    out["hinted_noret_cpu_over_unhinted_cpu"] = cpu_ratio(row, "kvkeeper+hints noret", "kvkeeper")
    out["hinted_cpu_over_router_cpu"] = cpu_ratio(row, f"kvkeeper+hints{first}", "vllm-router")
    out["floor_cpu_over_router_cpu"] = cpu_ratio(row, "aiohttp-floor", "vllm-router")
    out["hinted_cpu_over_floor_cpu"] = cpu_ratio(row, f"kvkeeper+hints{first}", "aiohttp-floor")
    return out


def requests_per_worker(folder: Path) -> list[float]:
    """Proxied requests counted by each worker (its own counter file), largest first."""
    from prometheus_client.multiprocess import MultiProcessCollector

    counts = []
    for db in folder.glob("counter_*.db"):
        total = 0.0
        for family in MultiProcessCollector.merge([str(db)], accumulate=False):  # type: ignore[no-untyped-call]
            for sample in family.samples:
                if sample.name == "kvkeeper_requests_total" and "chat" in sample.labels.get(
                    "route", ""
                ):
                    total += sample.value
        if total:
            counts.append(total)
    return sorted(counts, reverse=True)


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| concurrency | target | p50 ms | p99 ms | added p50 ms | added p99 ms | throughput vs direct | proxy CPU µs/req | + Redis CPU µs/req |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c, row in results.items():
        for name, d in row.items():
            if name.startswith("_"):
                continue
            cpu = "-" if d["cpu_us_per_request"] is None else f"{d['cpu_us_per_request']:.0f}"
            rcpu = d.get("redis_cpu_us_per_request")
            rcpu_s = "-" if rcpu is None else f"{rcpu:.0f}"
            lines.append(
                f"| {c} | {name} | {d['p50_ms']:.2f} | {d['p99_ms']:.2f} | {d['added_p50_ms']:+.2f} | {d['added_p99_ms']:+.2f} | {d['throughput_vs_direct']:.2f}x | {cpu} | {rcpu_s} |"
            )
    for c, row in results.items():
        shown = "; ".join(f"{k} = {v:.2f}" for k, v in row["_ratios"].items() if v is not None)
        lines.append(f"\nc={c}: {shown}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-upstream":
        serve_upstream(int(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "--serve-floor":
        serve_floor(int(sys.argv[2]), sys.argv[3])
    else:
        asyncio.run(main())
