"""``kvkeeper serve --workers 2``: both processes accept on the one port and share the requests,
one retention lease per engine across them, /metrics sums every worker (real processes, a real
redis-server, real HTTP engines)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import redis
from aiohttp import web
from prometheus_client.multiprocess import MultiProcessCollector

from tests.helpers.fake_engine import FakeEngine, serve_fake
from tests.helpers.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 1000  # two workers: 500 each expected, one standard deviation ~16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _requests_per_file(folder: Path) -> dict[str, float]:
    """kvkeeper_requests_total of the chat route, per worker (its own counter_<pid>.db)."""
    out: dict[str, float] = {}
    for db in folder.glob("counter_*.db"):
        for family in MultiProcessCollector.merge(  # type: ignore[no-untyped-call]
            [str(db)], accumulate=False
        ):
            for s in family.samples:
                chat = "chat/completions" in s.labels.get("route", "")
                if s.name == "kvkeeper_requests_total" and chat and s.labels.get("status") == "200":
                    out[db.name] = out.get(db.name, 0.0) + s.value
    return out


def _serve(env: dict[str, str], port: int, redis_url: str, *engines: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "proxy.cli", "serve", "--workers", "2", "--host", "127.0.0.1",
            "--port", str(port), "--redis", redis_url, "--log-level", "WARNING",
            *(arg for url in engines for arg in ("--engine", url)),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip


def _chat_requests(text: str) -> float:
    """kvkeeper_requests_total of 200-answered chat completions in a /metrics page."""
    return sum(
        float(m.group(2))
        for m in re.finditer(r"^kvkeeper_requests_total{([^}]*)} (\S+)$", text, re.M)
        if "chat/completions" in m.group(1) and 'status="200"' in m.group(1)
    )


async def test_two_workers_share_port_requests_lease_and_metrics(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    port = _free_port()
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "KVKEEPER_NAMESPACE": namespace,
        "KVKEEPER_RETENTION__TICK_S": "0.2",
        "PYTHONPATH": str(ROOT),
    }
    async with serve_fake(ScrapedEngine(name="a")) as a, serve_fake(ScrapedEngine(name="b")) as b:
        proc = _serve(env, port, redis_server.url, a.url, b.url)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert "listening" in line and "(2 workers)" in line, line
            base = f"http://127.0.0.1:{port}"
            chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            # a new connection per request: SO_REUSEPORT spreads connections, not requests
            conn = aiohttp.TCPConnector(force_close=True, limit=16)
            async with aiohttp.ClientSession(connector=conn) as http:

                async def one() -> int:
                    async with http.post(f"{base}/v1/chat/completions", json=chat) as r:
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(*(one() for _ in range(REQUESTS)))
                assert statuses.count(200) == REQUESTS
                per_worker = sorted(_requests_per_file(metrics_dir).values())
                assert len(per_worker) == 2 and sum(per_worker) == REQUESTS, per_worker
                assert per_worker[1] - per_worker[0] <= 0.2 * REQUESTS / 2, per_worker
                # /metrics answered by either worker counts both workers' requests
                for _ in range(4):
                    async with http.get(f"{base}/metrics") as r:
                        text = await r.text()
                    assert _chat_requests(text) == REQUESTS
                # one lease per engine, held by one worker's retention (holder|fence)
                store = redis.Redis.from_url(redis_server.url, decode_responses=True)
                deadline = time.monotonic() + 10
                holders: dict[str, str] = {}
                while time.monotonic() < deadline and len(holders) < 2:
                    for key in store.scan_iter(f"{namespace}:lease:engine:*"):
                        raw = store.get(key)
                        if raw is not None:
                            holders[str(key)] = str(raw).rsplit("|", 1)[0]
                    await asyncio.sleep(0.1)
                store.close()
                assert len(holders) == 2, holders
                # each engine's /metrics is scraped by its lease holder only: one scraper's rate
                before = {e.name: _scrapes(e) for e in (a, b)}
                await asyncio.sleep(4.0)
                for e in (a, b):
                    assert _scrapes(e) - before[e.name] <= 3, (e.name, _scrapes(e))
                # a worker killed -9 is replaced; once it is gone (the connections queued on its
                # socket go with it) the other worker answers everything meanwhile
                workers = _children(proc.pid)
                assert len(workers) == 2, workers
                os.kill(workers[0], signal.SIGKILL)
                await asyncio.sleep(0.5)
                statuses = await asyncio.gather(*(one() for _ in range(50)))
                assert statuses.count(200) == 50
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    now = _children(proc.pid)
                    if len(now) == 2 and workers[0] not in now:
                        break
                    await asyncio.sleep(0.2)
                assert len(now) == 2 and workers[0] not in now, now
        finally:
            proc.terminate()
            _, err = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0, err[-2000:]
        assert "Traceback" not in err, err[-2000:]


def _children(pid: int) -> list[int]:
    """The worker processes of the supervisor ``pid`` (its live children)."""
    raw = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in raw if Path(f"/proc/{c}/cmdline").read_bytes().find(b"spawn") >= 0]


class ScrapedEngine(FakeEngine):
    """A fake engine that also serves (an empty) /metrics and counts who asks."""

    scrapes: int = 0

    def app(self) -> web.Application:
        app = super().app()

        async def metrics(request: web.Request) -> web.Response:
            self.scrapes += 1
            return web.Response(text="")

        app.router.add_get("/metrics", metrics)
        return app


def _scrapes(engine: FakeEngine) -> int:
    return engine.scrapes if isinstance(engine, ScrapedEngine) else 0
