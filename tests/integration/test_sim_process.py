"""The simulator as a child process (``kvkeeper sim``), as benchmarks start it."""

from __future__ import annotations

import subprocess
import sys

import aiohttp

from loadgen.sim import SimConfig, run_simulator_process


async def test_subprocess_serves_and_reports_its_ports() -> None:
    config = SimConfig(num_blocks=128, profile="instant", cpu_blocks=64, model="proc")
    async with run_simulator_process(config) as sim, aiohttp.ClientSession() as http:
        assert sim.events_endpoint.startswith("tcp://127.0.0.1:")
        assert sim.lmcache_url is not None
        body = {"model": "proc", "prompt": list(range(100)), "max_tokens": 2}
        for expected in (0, 96):
            async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
                data = await resp.json()
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
        async with http.get(f"{sim.lmcache_url}/healthcheck") as resp:
            assert (await resp.json())["status"] == "healthy"


def test_cli_help_lists_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "sim", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    for flag in ("--num-blocks", "--block-size", "--events-port", "--profile", "--speed",
                 "--cpu-blocks", "--hash-seed", "--model", "--max-num-batched-tokens",
                 "--replay-port", "--lmcache-port"):  # fmt: skip
        assert flag in out
