"""The console behind ``kvkeeper serve --workers 2``: whichever worker answers, the engine's
series counts every worker's requests (real processes, the simulator, a real redis-server)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp

from loadgen.sim import SimConfig, run_simulator
from proxy.console_models import ConsoleEngines, ForestPage
from tests.helpers.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 60
ADMIN = {"Authorization": "Bearer admin-secret"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )


async def test_every_worker_shows_every_workers_traffic(
    redis_server: RedisServer, namespace: str
) -> None:
    port = _free_port()
    env = {
        **os.environ,
        "KVKEEPER_NAMESPACE": namespace,
        "KVKEEPER_ADMIN_TOKEN": "admin-secret",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # serve --workers makes its own
    async with run_simulator(SimConfig(num_blocks=300, speed=30.0, reply_tokens=1)) as sim:
        argv = [sys.executable, "-m", "proxy.cli", "serve", "--workers", "2"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--redis", redis_server.url]
        argv += ["--log-level", "WARNING", "--engine", sim.url]
        proc = _serve(argv, env)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert "(2 workers)" in line, line
            base = f"http://127.0.0.1:{port}"
            # a new connection per request: the kernel spreads connections over the workers
            conn = aiohttp.TCPConnector(force_close=True, limit=8)
            async with aiohttp.ClientSession(connector=conn) as http:

                async def one(i: int) -> None:
                    hint = {"session_id": f"s{i % 6}", "cache_control": {"ttl": 60}}
                    body = {"model": "sim", "prompt": list(range(100, 400)), "max_tokens": 1}
                    body["agent_hint"] = hint
                    async with http.post(f"{base}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()

                await asyncio.gather(*(one(i) for i in range(REQUESTS)))
                await asyncio.sleep(4.5)  # every worker's sampler has run since

                seen: list[int] = []
                for _ in range(6):
                    async with http.get(f"{base}/admin/console/engines", headers=ADMIN) as r:
                        assert r.status == 200, await r.text()
                        view = ConsoleEngines.model_validate(await r.json())
                    (engine,) = view.engines
                    seen.append(sum(p.requests for p in engine.series))
                    async with http.get(f"{base}/admin/console/forest", headers=ADMIN) as r:
                        page = ForestPage.model_validate(await r.json())
                    assert page.total_sessions == 6
                assert seen == [REQUESTS] * 6, seen
        finally:
            proc.terminate()
            _, err = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
