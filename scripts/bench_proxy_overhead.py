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

``--saturate`` measures capacity instead: closed loop at ``--sat-c`` clients (256), each target
for ``--seconds`` per round after ``--warmup``, rounds interleaved, the clients spread over
``--load-procs`` load processes (each its own aiohttp client on uvloop), the upstream in
``--upstream-procs`` processes sharing its port (SO_REUSEPORT), the parts pinned to their own
cores with ``--pin proxy=0-5,upstream=6-9,redis=10,load=11-15`` (kvkeeper's workers and the
router's threads inherit the proxy's set). Targets: direct, aiohttp-floor, vllm-router
cache_aware and round_robin, kvkeeper unhinted and hinted at each ``--workers`` count. Per target:
req/s, latency percentiles, proxy cores used and CPU per request, Redis CPU per request, and the
load processes' own CPU (all, and the busiest one: the load generator is not the limit while
direct runs far faster and no load process is near one core). Writes
results/proxy_saturation.json (after every round) and prints a table and the ratios issue 29
asks for: hinted req/s at the most workers, scaling as a fraction of linear, hinted CPU per
request over vllm-router cache_aware's.

    python scripts/bench_proxy_overhead.py --saturate --workers 1,6 --load-procs 5 \
        --upstream-procs 4 --pin proxy=0-5,upstream=6-9,redis=10,load=11-15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
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
BODY: dict[str, Any] = {
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
def upstream_app() -> Any:
    """The fast upstream: answers every chat completion at once with the same small body."""
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
    return app


def serve_upstream(port: int, reuse_port: bool = False) -> None:
    """The upstream in a process of its own; with ``reuse_port`` several share the port."""
    _run(upstream_app(), port, reuse_port)


def _run(app: Any, port: int, reuse_port: bool = False) -> None:
    """Serve ``app`` on uvloop when installed, quietly (the bench servers' own processes)."""
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(
        app, host="127.0.0.1", port=port, access_log=None, print=None, reuse_port=reuse_port or None
    )


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
def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (kvkeeper's workers, a pool's children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and all its live descendants, from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in descendants(pid):
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


LOG_DIR = ROOT / "results"


def spawn(
    cmd: list[str],
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
    tag: str = "",
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session, its output in a log file, pinned to ``cpus`` if given
    (threads and processes it starts inherit the set)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    name = f"bench-{Path(cmd[0]).name}-{tag or len(cmd)}.log"
    log = open(LOG_DIR / name, "wb")  # noqa: SIM115
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )


def spawn_kvkeeper(
    port: int,
    upstream: str,
    redis_port: int,
    workers: int,
    metrics_dirs: dict[int, Path],
    cpus: set[int] | None = None,
    tag: str = "",
) -> subprocess.Popen[bytes]:
    """``kvkeeper serve`` with ``workers`` processes in front of ``upstream``; several workers
    count in files of their own (``metrics_dirs[workers]``: requests per worker)."""
    env = {}
    if workers > 1:
        metrics_dirs[workers] = Path(tempfile.mkdtemp(prefix=f"bench-w{workers}-"))
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dirs[workers])
    return spawn(
        [
            sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
            "--engine", upstream, "--redis", f"redis://127.0.0.1:{redis_port}/0",
            "--log-level", "WARNING", "--workers", str(workers),
        ],
        env,
        cpus=cpus,
        tag=tag,
    )  # fmt: skip


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
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default under results/)")
    sat = ap.add_argument_group(
        "saturation (--saturate)",
        "closed loop at high concurrency, each target for --seconds per round (rounds "
        "interleaved), from several load processes, cores pinned: req/s, proxy cores used and "
        "CPU per request, the load generator's own CPU",
    )
    sat.add_argument("--saturate", action="store_true", help="run the saturation mode")
    sat.add_argument("--sat-c", default="256", help="closed-loop clients in all (comma list)")
    sat.add_argument("--seconds", type=float, default=5.0, help="measured window per target")
    sat.add_argument("--warmup", type=float, default=1.0, help="load before each window")
    sat.add_argument("--load-procs", type=int, default=1, help="load generator processes")
    sat.add_argument("--upstream-procs", type=int, default=1, help="upstream processes")
    sat.add_argument(
        "--pin", default="", help="CPUs per role, e.g. proxy=0-5,upstream=6-9,redis=10,load=11-15"
    )
    sat.add_argument("--router-policies", default="cache_aware,round_robin")
    sat.add_argument("--sessions", type=int, default=500, help="hinted sessions in the load")
    sat.add_argument("--only", default="", help="only these targets (comma list; direct stays)")
    sat.add_argument("--log-dir", type=Path, default=None, help="the servers' logs (results/)")
    args = ap.parse_args()
    if args.log_dir is not None:
        global LOG_DIR
        LOG_DIR = args.log_dir
    if args.saturate:
        args.out = args.out or ROOT / "results" / "proxy_saturation.json"
        await saturate(args)
        return
    args.out = args.out or ROOT / "results" / "proxy_overhead.json"

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
        kvk = spawn_kvkeeper(port, upstream, redis_port, n, metrics_dirs)
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


# --- saturation: closed loop from several load processes, cores pinned ------------------------
PIN_ROLES = ("proxy", "upstream", "redis", "load")
JSON_HEADERS = {"Content-Type": "application/json"}


def parse_cpus(token: str) -> set[int]:
    """``3`` or ``0-5`` -> the CPU numbers it names."""
    lo, sep, hi = token.strip().partition("-")
    try:
        first = int(lo)
        last = int(hi) if sep else first
    except ValueError:
        raise ValueError(f"bad CPU range {token!r} (want N or N-M)") from None
    if first < 0 or last < first:
        raise ValueError(f"bad CPU range {token!r} (want N or N-M with N <= M)")
    return set(range(first, last + 1))


def parse_pin(spec: str) -> dict[str, set[int]]:
    """``proxy=0-5,upstream=6-9,redis=10,load=11-15`` -> CPUs per role; a range with no ``role=``
    belongs to the role before it (``proxy=0-2,4``). Roles: proxy, upstream, redis, load."""
    pins: dict[str, set[int]] = {}
    role: str | None = None
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        if "=" in token:
            role, token = (x.strip() for x in token.split("=", 1))
            if role not in PIN_ROLES:
                raise ValueError(f"unknown role {role!r} in --pin (roles: {', '.join(PIN_ROLES)})")
            if role in pins:
                raise ValueError(f"role {role!r} given twice in --pin")
            pins[role] = set()
        if role is None:
            raise ValueError(f"--pin {spec!r}: CPUs before any role=")
        pins[role] |= parse_cpus(token)
    return pins


def split_clients(total: int, procs: int) -> list[int]:
    """``total`` closed-loop clients over at most ``procs`` load processes, as evenly as possible."""
    procs = max(1, min(procs, total))
    base, extra = divmod(total, procs)
    return [base + (1 if i < extra else 0) for i in range(procs)]


def request_bodies(hinted: bool, sessions: int, prompt_chars: int) -> list[bytes]:
    """The request bodies a load process cycles through, serialised once: one plain body, or one
    per session (agent_hint session + TTL, like the latency mode's hinted requests)."""
    base = agent_body(prompt_chars)
    if not hinted:
        return [json.dumps(base).encode()]
    return [
        json.dumps(
            {
                **base,
                "agent_hint": {
                    "session_id": f"s{k}",
                    "cache_control": {"type": "ephemeral", "ttl": 300},
                },
            }
        ).encode()
        for k in range(max(1, sessions))
    ]


def load_worker(cfg_json: str) -> None:
    """One load process (``--load-worker CONFIG``): prints ``ready``, reads the measuring window
    ``t_start t_end`` (wall clock) from stdin, runs its closed-loop clients until ``t_end`` and
    prints its report as one JSON line: latencies (µs) and errors of the requests that ended in
    the window, and its own CPU seconds over the window."""
    cfg = json.loads(cfg_json)
    print("ready", flush=True)
    t_start, t_end = (float(x) for x in sys.stdin.readline().split())
    try:
        import uvloop

        report = uvloop.run(_load_window(cfg, t_start, t_end))
    except ImportError:
        report = asyncio.run(_load_window(cfg, t_start, t_end))
    print(json.dumps(report), flush=True)


async def _load_window(cfg: dict[str, Any], t_start: float, t_end: float) -> dict[str, Any]:
    bodies = request_bodies(cfg["hinted"], cfg["sessions"], cfg["prompt_chars"])
    url, offset = cfg["url"], cfg["offset"]
    lat: list[int] = []
    errors = 0
    clock: dict[str, float] = {}

    async def window_clock() -> None:
        await asyncio.sleep(max(0.0, t_start - time.time()))
        clock["late_s"] = time.time() - t_start
        clock["cpu0"] = time.process_time()
        await asyncio.sleep(max(0.0, t_end - time.time()))
        clock["cpu1"] = time.process_time()

    async def client(s: aiohttp.ClientSession, w: int) -> None:
        nonlocal errors
        i = (offset + w) * 7919
        while time.time() < t_end:
            body = bodies[i % len(bodies)]
            i += 1
            t0 = time.perf_counter()
            try:
                async with s.post(url, data=body, headers=JSON_HEADERS) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, OSError):
                ok = False
            if t_start <= time.time() <= t_end:
                if ok:
                    lat.append(int((time.perf_counter() - t0) * 1e6))
                else:
                    errors += 1
            if not ok:  # a failing target is not spun on
                await asyncio.sleep(0.01)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
        await asyncio.gather(window_clock(), *(client(s, w) for w in range(cfg["clients"])))
    return {
        "lat_us": lat,
        "errors": errors,
        "cpu_s": clock["cpu1"] - clock["cpu0"],
        "late_s": clock["late_s"],
    }


def aggregate(parts: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """One target's window from its load processes' reports: total req/s, latency percentiles
    over every request, and the load processes' own CPU (all of them, and the busiest one)."""
    lat = sorted(x for p in parts for x in p["lat_us"])
    cpu = [float(p["cpu_s"]) for p in parts]

    def ms(q: float) -> float | None:
        return pct(lat, q) / 1e3 if lat else None

    return {
        "requests": len(lat),
        "errors": sum(int(p["errors"]) for p in parts),
        "rps": len(lat) / window_s,
        "p50_ms": ms(0.5),
        "p99_ms": ms(0.99),
        "p999_ms": ms(0.999),
        "load_cores": sum(cpu) / window_s,
        "load_busiest_proc": max(cpu, default=0.0) / window_s,
        "load_late_s": max((float(p["late_s"]) for p in parts), default=0.0),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A target's rounds in one row: medians, the errors summed, each round's req/s kept."""

    def med(key: str) -> float | None:
        values = [r[key] for r in rounds if r.get(key) is not None]
        return statistics.median(values) if values else None

    keys = (
        "rps", "p50_ms", "p99_ms", "p999_ms", "proxy_cores", "proxy_cpu_us_per_req",
        "redis_cpu_us_per_req", "upstream_cores", "load_cores", "load_busiest_proc",
    )  # fmt: skip
    out: dict[str, Any] = {k: med(k) for k in keys}
    out["errors"] = sum(r["errors"] for r in rounds)
    out["rps_rounds"] = [round(r["rps"], 1) for r in rounds]
    return out


def wtag(n: int) -> str:
    return "" if n == 1 else f" w{n}"


def saturation_ratios(row: dict[str, Any], worker_counts: list[int]) -> dict[str, float | None]:
    """The issue's figures: hinted req/s at the most workers, scaling from the fewest to the most
    workers as a fraction of linear, and CPU per request against vllm-router cache_aware."""
    lo, hi = min(worker_counts), max(worker_counts)

    def get(name: str, key: str) -> float | None:
        value = row.get(name, {}).get(key)
        return None if value is None else float(value)

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    hinted_hi, plain_hi = f"kvkeeper+hints{wtag(hi)}", f"kvkeeper{wtag(hi)}"
    out: dict[str, float | None] = {f"hinted_rps_w{hi}": get(hinted_hi, "rps")}
    if hi != lo:
        for short, name in (("hinted", "kvkeeper+hints"), ("unhinted", "kvkeeper")):
            low = get(f"{name}{wtag(lo)}", "rps")
            out[f"{short}_scaling_w{lo}_to_w{hi}_of_linear"] = div(
                get(f"{name}{wtag(hi)}", "rps"), None if low is None else low * hi / lo
            )
    router_cpu = get("vllm-router", "proxy_cpu_us_per_req")
    for n in sorted({lo, hi}):
        out[f"hinted_cpu_w{n}_over_router_cache_aware"] = div(
            get(f"kvkeeper+hints{wtag(n)}", "proxy_cpu_us_per_req"), router_cpu
        )
    out[f"hinted_cpu_over_unhinted_w{hi}"] = div(
        get(hinted_hi, "proxy_cpu_us_per_req"), get(plain_hi, "proxy_cpu_us_per_req")
    )
    out[f"direct_rps_over_hinted_w{hi}"] = div(get("direct", "rps"), get(hinted_hi, "rps"))
    out[f"router_round_robin_rps_over_hinted_w{hi}"] = div(
        get("vllm-router rr", "rps"), get(hinted_hi, "rps")
    )
    return out


def render_saturation(results: dict[str, dict[str, Any]], cpus: dict[str, int]) -> str:
    lines = [
        f"cores: {', '.join(f'{k} {v}' for k, v in cpus.items())}",
        "",
        "| c | target | req/s (median) | req/s per round | p50 ms | p99 ms | proxy cores used | proxy CPU µs/req | Redis CPU µs/req | upstream cores | load cores (busiest proc) | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for c, row in results.items():
        for name, d in row.items():
            if name.startswith("_"):
                continue
            rounds = "/".join(f"{x:,.0f}" for x in d["rps_rounds"])
            lines.append(
                f"| {c} | {name} | {f(d['rps'], ',.0f')} | {rounds} | {f(d['p50_ms'], '.2f')} | "
                f"{f(d['p99_ms'], '.2f')} | {f(d['proxy_cores'], '.2f')} | "
                f"{f(d['proxy_cpu_us_per_req'], '.0f')} | {f(d['redis_cpu_us_per_req'], '.0f')} | "
                f"{f(d['upstream_cores'], '.2f')} | {f(d['load_cores'], '.2f')} "
                f"({f(d['load_busiest_proc'], '.2f')}) | {d['errors']} |"
            )
    for c, row in results.items():
        shown = "; ".join(f"{k} = {v:.2f}" for k, v in row["_ratios"].items() if v is not None)
        lines.append(f"\nc={c}: {shown}")
    return "\n".join(lines)


async def saturate(args: argparse.Namespace) -> None:
    """Each target in turn, closed loop at each concurrency, for ``--seconds`` per round from
    ``--load-procs`` load processes; the proxy's CPU read over the same window."""
    pins = parse_pin(args.pin)
    available = os.sched_getaffinity(0)
    for role, cpus in pins.items():
        if not cpus <= available:
            raise SystemExit(f"--pin {role}: CPUs {sorted(cpus - available)} are not available")
    pins.setdefault("redis", pins.get("upstream", set()))
    proxy_cpus = pins.get("proxy") or None
    load_cpus = sorted(pins.get("load", set()))
    worker_counts = [int(x) for x in args.workers.split(",")]
    procs: list[subprocess.Popen[bytes]] = []
    metrics_dirs: dict[int, Path] = {}

    up_port, redis_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    upstream_procs = [
        spawn(
            [sys.executable, __file__, "--serve-upstream", str(up_port), "reuse"],
            cpus=pins.get("upstream") or None,
            tag=f"upstream{i}",
        )
        for i in range(args.upstream_procs)
    ]
    procs += upstream_procs
    redis = spawn(
        ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
        cpus=pins["redis"] or None,
    )
    procs.append(redis)
    # name -> (url, pid of the proxy or None, hinted, health path)
    targets: dict[str, tuple[str, int | None, bool, str]] = {
        "direct": (upstream, None, False, "/health")
    }
    if not args.no_floor:
        port = free_port()
        floor = spawn(
            [sys.executable, __file__, "--serve-floor", str(port), upstream],
            cpus=proxy_cpus,
            tag="floor",
        )
        procs.append(floor)
        targets["aiohttp-floor"] = (f"http://127.0.0.1:{port}", floor.pid, False, "/health")
    if args.router:
        for policy in [p for p in args.router_policies.split(",") if p]:
            port = free_port()
            router = spawn(
                [
                    *shlex.split(args.router), "--host", "127.0.0.1", "--port", str(port),
                    "--worker-urls", upstream, "--policy", policy, "--log-level", "error",
                    "--prometheus-port", str(free_port()),
                ],
                cpus=proxy_cpus,
                tag=f"router-{policy}",
            )  # fmt: skip
            procs.append(router)
            name = "vllm-router" if policy == "cache_aware" else f"vllm-router {policy}"
            name = name.replace("round_robin", "rr")
            targets[name] = (f"http://127.0.0.1:{port}", router.pid, False, "/health")
    for n in worker_counts:
        port = free_port()
        kvk = spawn_kvkeeper(
            port, upstream, redis_port, n, metrics_dirs, cpus=proxy_cpus, tag=f"kvkeeper-w{n}"
        )
        procs.append(kvk)
        url = f"http://127.0.0.1:{port}"
        targets[f"kvkeeper{wtag(n)}"] = (url, kvk.pid, False, "/healthz")
        targets[f"kvkeeper+hints{wtag(n)}"] = (url, kvk.pid, True, "/healthz")
    if args.only:
        keep = set(args.only.split(","))
        targets = {k: v for k, v in targets.items() if k in keep or k == "direct"}

    def window(name: str, c: int) -> dict[str, Any]:
        url, pid, hinted, _ = targets[name]
        shares = split_clients(c, args.load_procs)
        loaders = []
        for i, clients in enumerate(shares):
            cfg = {
                "url": url + "/v1/chat/completions", "clients": clients, "hinted": hinted,
                "sessions": args.sessions, "prompt_chars": args.prompt_chars,
                "offset": sum(shares[:i]),
            }  # fmt: skip
            cpus = {load_cpus[i % len(load_cpus)]} if load_cpus else None
            if load_cpus and len(shares) > len(load_cpus):
                cpus = set(load_cpus)
            loaders.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--load-worker", json.dumps(cfg)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    preexec_fn=(lambda cpus=cpus: os.sched_setaffinity(0, cpus)) if cpus else None,
                    text=True,
                )
            )
        try:
            for p in loaders:
                assert p.stdout is not None and p.stdin is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a load process for {name} did not start")
            t_start = time.time() + args.warmup
            t_end = t_start + args.seconds
            for p in loaders:
                assert p.stdin is not None
                p.stdin.write(f"{t_start} {t_end}\n")
                p.stdin.close()
            time.sleep(max(0.0, t_start - time.time()))
            cpu0 = cpu_seconds(pid) if pid else 0.0
            rcpu0 = cpu_seconds(redis.pid)
            ucpu0 = sum(cpu_seconds(u.pid) for u in upstream_procs)
            time.sleep(max(0.0, t_end - time.time()))
            cpu1 = cpu_seconds(pid) if pid else 0.0
            rcpu1 = cpu_seconds(redis.pid)
            ucpu1 = sum(cpu_seconds(u.pid) for u in upstream_procs)
            parts = []
            for p in loaders:
                assert p.stdout is not None
                out = p.stdout.read()  # ends by t_end + one request (30 s at most)
                if p.wait(timeout=30) != 0:
                    raise RuntimeError(f"a load process for {name} exited {p.returncode}")
                parts.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in loaders:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        row = aggregate(parts, args.seconds)
        n = max(1, row["requests"])
        row["proxy_cores"] = (cpu1 - cpu0) / args.seconds if pid else None
        row["proxy_cpu_us_per_req"] = (cpu1 - cpu0) / n * 1e6 if pid else None
        row["redis_cpu_us_per_req"] = (
            (rcpu1 - rcpu0) / n * 1e6 if name.startswith("kvkeeper") else None
        )
        row["upstream_cores"] = (ucpu1 - ucpu0) / args.seconds
        return row

    try:
        await wait_http(upstream + "/health")
        for url, _, _, health in targets.values():
            await wait_http(url + health, 120)
        cpus_used = {
            "available": len(available),
            **{role: len(pins[role]) for role in PIN_ROLES if pins.get(role)},
            "load procs": min(args.load_procs, max(1, min(int(x) for x in args.sat_c.split(",")))),
            "upstream procs": args.upstream_procs,
        }
        print(f"saturation: {cpus_used}; targets: {', '.join(targets)}", file=sys.stderr)
        results: dict[str, dict[str, Any]] = {}
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {}

        def write() -> None:  # after every round: a run cut short still leaves its rounds
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(
                    {
                        "mode": "saturate",
                        "seconds": args.seconds,
                        "warmup": args.warmup,
                        "rounds": args.rounds,
                        "concurrency": args.sat_c,
                        "load_procs": args.load_procs,
                        "upstream_procs": args.upstream_procs,
                        "sessions": args.sessions,
                        "prompt_chars": args.prompt_chars,
                        "pin": {role: sorted(cpus) for role, cpus in pins.items()},
                        "cpus": cpus_used,
                        "python": sys.version.split()[0],
                        "results": results,
                        "rounds_raw": raw,
                        "requests_per_worker": spread,
                    },
                    indent=2,
                )
            )

        spread: dict[int, list[float]] = {}
        for c in (int(x) for x in args.sat_c.split(",")):
            per: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
            raw[str(c)] = per
            for rnd in range(args.rounds):
                order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
                for name in order:
                    row = window(name, c)
                    per[name].append(row)
                    print(
                        f"c={c} round {rnd + 1}/{args.rounds} {name}: {row['rps']:,.0f} req/s, "
                        f"proxy {row['proxy_cores'] or 0:.2f} cores, "
                        f"load {row['load_cores']:.2f} cores (busiest {row['load_busiest_proc']:.2f}), "
                        f"{row['errors']} errors",
                        file=sys.stderr,
                    )
                results[str(c)] = {name: summarize(rows) for name, rows in per.items()}
                results[str(c)]["_ratios"] = saturation_ratios(results[str(c)], worker_counts)
                write()
        spread = {n: requests_per_worker(folder) for n, folder in metrics_dirs.items()}
        write()
        print(render_saturation(results, cpus_used))
        for n, counts in spread.items():
            if counts:
                print(
                    f"workers={n}: requests per worker {counts} "
                    f"(max/min {max(counts) / min(counts):.2f})"
                )
    finally:
        for p in reversed(procs):  # the proxies before Redis and the upstream
            stop(p)
        for folder in metrics_dirs.values():
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--serve-upstream":
        serve_upstream(int(sys.argv[2]), reuse_port=sys.argv[3:] == ["reuse"])
    elif len(sys.argv) == 3 and sys.argv[1] == "--load-worker":
        load_worker(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "--serve-floor":
        serve_floor(int(sys.argv[2]), sys.argv[3])
    else:
        asyncio.run(main())
