"""``kvkeeper serve --workers 2`` in front of ``kvkeeper sim``: one KV-event subscriber per
engine (the holder of its retention lease), its residency relayed to the other worker, the
subscription taken over when the holder is killed, and retention still protecting a session
through a flood (real processes: the simulator, the workers, a real redis-server)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.sim import SimConfig, run_simulator_process
from proxy.retention import LEASE_TTL_S
from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import cached, prompt
from tests.integration.test_workers import _children, _free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": "Bearer admin-secret"}
FULL = 2016  # a 2,017-token prompt: 63 full blocks of 32


def _subscribers(port: int, pids: list[int]) -> dict[int, int]:
    """Established TCP connections to the publisher's ``port``, per process of ``pids``: what
    the engine side sees as subscribers, read from the kernel, not from kvkeeper."""
    inodes: set[str] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if remote_port == port and fields[3] == "01":  # ESTABLISHED, the client's end
            inodes.add(f"socket:[{fields[9]}]")
    out: dict[int, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone meanwhile
            continue
        n = 0
        for fd in fds:
            try:
                n += os.readlink(fd) in inodes
            except OSError:
                continue
        out[pid] = n
    return out


def _serve(
    env: dict[str, str], port: int, redis_url: str, url: str, events: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "proxy.cli", "serve", "--workers", "2", "--host", "127.0.0.1",
            "--port", str(port), "--redis", redis_url, "--log-level", "WARNING",
            "--engine", url, "--engine-events", events,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


async def _until(predicate: Any, within: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(step)
    return False


async def test_one_subscriber_per_engine_relayed_taken_over_and_retention_works(
    redis_server: RedisServer, namespace: str
) -> None:
    config = SimConfig(num_blocks=200, speed=20.0, reply_tokens=1, model="sim")
    async with run_simulator_process(config) as sim:
        events_port = int(sim.events_endpoint.rsplit(":", 1)[1])
        port = _free_port()
        env = {
            **os.environ,
            "KVKEEPER_NAMESPACE": namespace,
            "KVKEEPER_RETENTION__TICK_S": "0.05",
            "KVKEEPER_ADMIN_TOKEN": "admin-secret",
            "PYTHONPATH": str(ROOT),
        }
        proc = _serve(env, port, redis_server.url, sim.url, sim.events_endpoint)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert "(2 workers)" in line, line
            base = f"http://127.0.0.1:{port}"
            conn = aiohttp.TCPConnector(force_close=True)  # each request: either worker
            async with aiohttp.ClientSession(connector=conn) as http:

                async def complete(tokens: list[int], hint: dict[str, Any] | None = None) -> int:
                    body: dict[str, Any] = {"model": "sim", "prompt": tokens, "max_tokens": 1}
                    if hint is not None:
                        body["agent_hint"] = hint
                    async with http.post(f"{base}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        return cached(await r.json())

                async def summed() -> float:  # /metrics of either worker sums both
                    async with http.get(f"{base}/metrics") as r:
                        return _metric(await r.text(), "kvkeeper_kv_event_subscriptions")

                workers = _children(proc.pid)
                assert len(workers) == 2, workers

                async def one_subscriber() -> bool:
                    seen = _subscribers(events_port, _children(proc.pid))
                    return sorted(seen.values()) == [0, 1] and await summed() == 1

                assert await _until(one_subscriber, 15), _subscribers(events_port, workers)
                # the other worker learns the residency (and the hash check) from the holder's relay
                await complete(prompt(7))
                views: dict[str, dict[str, Any]] = {}

                async def both_views() -> bool:
                    async with http.get(f"{base}/admin/engines", headers=ADMIN) as r:
                        engine = (await r.json())["data"][0]
                    kv = {**engine["retention"]["kv_events"], "hashes": engine["hash_check"]}
                    views[kv["source"]] = kv
                    relay = views.get("relay", {})
                    checked = all(v["hashes"]["status"] == "ok" for v in views.values())
                    return "own" in views and relay.get("relayed_batches", 0) > 0 and checked

                assert await _until(both_views, 15, step=0.05), views
                assert views["own"]["subscribed"] and not views["relay"]["subscribed"]
                # the holder killed -9: the other worker (or its replacement) subscribes once the
                # lease it held expires
                holder = next(p for p, n in _subscribers(events_port, workers).items() if n)
                os.kill(holder, signal.SIGKILL)
                killed_at = time.monotonic()

                async def taken_over() -> bool:
                    seen = _subscribers(events_port, _children(proc.pid))
                    return holder not in seen and sum(seen.values()) == 1

                assert await _until(taken_over, LEASE_TTL_S + 5, step=0.05)
                took = time.monotonic() - killed_at
                assert took < LEASE_TTL_S + 2.0, took
                assert await _until(lambda: one_subscriber(), 10)
                # retention under two workers: a protected session survives a flood that evicts
                # an unprotected one (either worker serves each request)
                await complete(prompt(1), {"session_id": "kept", "cache_control": {"ttl": 300}})
                await complete(prompt(2), {"session_id": "plain"})

                async def learned() -> bool:  # the session's block ids, in Redis for every worker
                    async with http.get(f"{base}/admin/sessions/kept", headers=ADMIN) as r:
                        return bool((await r.json())["residency"]["blocks"] == 63)

                assert await _until(learned, 10)
                for i in range(8):  # 8 x 63 blocks through a 200-block pool, paced for the
                    await complete(prompt(100 + i))  # retention tick of a loaded 2-core machine
                    await asyncio.sleep(0.25)
                assert await complete(prompt(1), {"session_id": "kept"}) >= 0.95 * FULL
                assert await complete(prompt(2), {"session_id": "plain"}) == 0
        finally:
            proc.terminate()
            _, err = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
