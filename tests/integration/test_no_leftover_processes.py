"""Nothing kvkeeper starts outlives it: the embedded redis-server, the demo's and benchmarks'
stacks, and ``serve``'s workers stop on a normal exit, an exception, SIGTERM, and when the
process that started them is killed. Real processes, found by a marker in their environment."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from loadgen.sim.server import SimConfig
from loadgen.stack import free_port, start_kvkeeper, start_sims
from proxy.embedded import EmbeddedRedis
from tests.helpers.procs import Mark, kill_marked, marked, redis_servers, wait_for

UP_S = 120.0  # a loaded 2-core machine starts a Python stack slowly
GONE_S = 15.0


@pytest.fixture
def mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mark]:
    """A marker every process started from here inherits; leftovers are killed at the end."""
    value = Mark(tmp_path)
    for name, v in value.env().items():
        monkeypatch.setenv(name, v)
    monkeypatch.setattr(tempfile, "tempdir", None)  # this process's temporary folders too
    try:
        yield value
    finally:
        kill_marked(value)


def _child_env(mark: Mark) -> dict[str, str]:
    return {**os.environ, **mark.env()}


async def test_stop_ends_the_embedded_redis_with_clients_still_connected(mark: Mark) -> None:
    embedded = EmbeddedRedis()
    url = await embedded.start()
    clients = [aioredis.Redis.from_url(url) for _ in range(3)]
    try:
        for client in clients:
            assert await client.ping()
        assert len(redis_servers(mark)) == 1
        folder = embedded.folder
        await embedded.stop()  # the clients are still open, as a crashed drain would leave them
        assert redis_servers(mark) == {}
        assert not folder.exists()
    finally:
        for client in clients:
            await client.aclose(close_connection_pool=True)


def test_the_embedded_redis_dies_with_the_process_that_started_it(mark: Mark) -> None:
    code = (
        "import asyncio, time\n"
        "from proxy.embedded import EmbeddedRedis\n"
        "e = EmbeddedRedis()\n"
        "print(asyncio.run(e.start()), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert _first_line(proc).startswith("unix://")
        assert len(redis_servers(mark)) == 1
    finally:
        proc.kill()
        proc.wait()
    assert wait_for(mark, redis_only=False, gone=True, timeout_s=GONE_S) == {}


async def test_a_stack_with_the_embedded_redis_leaves_nothing_after_an_exception(
    mark: Mark, tmp_path: Path
) -> None:
    sim = SimConfig(num_blocks=300, speed=30.0, reply_tokens=1)
    seen: list[int] = []

    async def run() -> None:
        async with start_sims(sim) as sims, start_kvkeeper(sims, None, tmp_path / "logs"):
            seen.append(len(redis_servers(mark)))
            raise RuntimeError("mid-run")

    with pytest.raises(RuntimeError, match="mid-run"):
        await run()
    assert seen == [1]  # kvkeeper's own (no URL given) was up
    assert marked(mark) == {}


def _serve(mark: Mark, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--engine", "http://127.0.0.1:9"]
    argv += ["--host", "127.0.0.1", "--log-level", "WARNING", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=_child_env(mark))


def _first_line(proc: subprocess.Popen[str]) -> str:
    """The child's first line of output, waiting at most ``UP_S``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], UP_S)
    assert ready, f"no output within {UP_S:.0f} s"
    return proc.stdout.readline()


def _listening(proc: subprocess.Popen[str]) -> None:
    line = _first_line(proc)
    assert "kvkeeper listening" in line, line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_serve_without_redis_leaves_no_redis_server(mark: Mark, sig: signal.Signals) -> None:
    proc = _serve(mark, "--port", "0")
    try:
        _listening(proc)
        assert len(redis_servers(mark)) == 1
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == (-sig if sig == signal.SIGKILL else 0)
    finally:
        proc.kill()
        proc.wait()
    assert wait_for(mark, redis_only=False, gone=True, timeout_s=GONE_S) == {}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_serve_workers_and_their_redis_go_with_the_supervisor(
    mark: Mark, sig: signal.Signals
) -> None:
    proc = _serve(mark, "--port", str(free_port()), "--workers", "2")
    try:
        _listening(proc)
        assert len(redis_servers(mark)) == 1
        workers = [cmd for cmd in marked(mark).values() if "spawn_main" in cmd]
        assert len(workers) == 2
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    # the killed supervisor's workers drain (SIGTERM from the kernel) before they go
    assert wait_for(mark, redis_only=False, gone=True, timeout_s=GONE_S + 30) == {}


def _demo(mark: Mark, out: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "proxy.cli", "demo", "--users", "4", "--time-scale", "0.05"]
    argv += ["--speed", "20", "--num-blocks", "700", "--tier-blocks", "700", "--rounds", "3"]
    argv += ["--out", str(out)]
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=_child_env(mark)
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_demo_stopped_while_kvkeeper_runs_leaves_nothing(
    mark: Mark, tmp_path: Path, sig: signal.Signals
) -> None:
    proc = _demo(mark, tmp_path / "demo")
    try:
        # the kvkeeper stack is up once its embedded redis-server is
        up = wait_for(mark, redis_only=True, gone=False, timeout_s=UP_S)
        assert up, "the demo never started kvkeeper's stack"
        assert proc.poll() is None
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert wait_for(mark, redis_only=False, gone=True, timeout_s=GONE_S) == {}
