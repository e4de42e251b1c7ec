"""Assemble and run the simulator: engine + OpenAI app + ZMQ events (+ LMCache app).

In-process (tests, demo)::

    async with run_simulator(SimConfig(num_blocks=200)) as sim:
        sim.url, sim.events_endpoint, sim.replay_endpoint, sim.lmcache_url, sim.engine

As a subprocess (benchmarks that must not share the event loop)::

    async with run_simulator_process(SimConfig(...)) as sim:   # same attributes but ``engine``

Every port may be 0: the real port is read back after binding.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

import loadgen.sim.routes_misc as routes_misc
import loadgen.sim.routes_openai as routes_openai
import loadgen.sim.routes_responses as routes_responses
from loadgen.sim.api import ENGINE, MODEL, REPLY, TOKENIZER, error_middleware
from loadgen.sim.belady import EvictRule
from loadgen.sim.engine import EngineConfig, SchedulingPolicy, SimEngine
from loadgen.sim.events import EventPublisher
from loadgen.sim.exposition import EngineCollector
from loadgen.sim.lmcache_api import ADDRESS, create_lmcache_app
from loadgen.sim.profiles import get_profile
from loadgen.sim.tokenizer import SimTokenizer
from proxy.children import tied_to_parent

REPLY_TEXT = (
    " This is a simulated answer from the kvkeeper engine simulator, which models a KV cache"
    " and its timing but runs no model."
)
_READY = "KVKEEPER_SIM_READY "


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything ``kvkeeper sim`` takes; ports of 0 bind ephemeral ports."""

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim"
    num_blocks: int = 2048
    block_size: int = 32
    hash_seed: str = "0"
    profile: str = "cpu-smollm2"
    speed: float = 1.0
    max_lag_s: float = 1.0  # how far the step loop may run behind its modelled clock
    events_port: int = 0
    replay_port: int | None = 0  # None: no replay endpoint
    topic: str = "kv"
    cpu_blocks: int = 0
    cpu_l2_blocks: int = 0  # the CPU tier's L2 (0: one level that pins protect)
    cpu_l2_load_factor: float = 4.0
    lmcache_port: int = 0  # used only with cpu_blocks > 0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    max_model_len: int = 131_072
    reply_tokens: int = 16
    scheduling_policy: SchedulingPolicy = "fcfs"
    evict_oracle: str = ""  # Belady eviction from this oracle file (loadgen/sim/belady.py)
    evict_rule: EvictRule = "belady"  # or "dead-first": only never-used-again blocks go first

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            hash_seed=self.hash_seed,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_model_len=self.max_model_len,
            cpu_blocks=self.cpu_blocks,
            cpu_l2_blocks=self.cpu_l2_blocks,
            cpu_l2_load_factor=self.cpu_l2_load_factor,
            speed=self.speed,
            max_lag_s=self.max_lag_s,
            reply_tokens=self.reply_tokens,
            scheduling_policy=self.scheduling_policy,
            evict_oracle=self.evict_oracle,
            evict_rule=self.evict_rule,
        )


@dataclass(frozen=True, slots=True)
class SimEndpoints:
    """Where a running simulator answers."""

    url: str
    events_endpoint: str
    replay_endpoint: str | None
    lmcache_url: str | None

    def kvkeeper_engine(
        self, model_name: str = "sim", *, events: bool = True, tier: bool = True
    ) -> dict[str, Any]:
        """This simulator as an entry of kvkeeper's ``engines`` setting: its URL, its KV-event
        endpoint (``events``) and its LMCache-shaped tier when it serves one (``tier``)."""
        engine: dict[str, Any] = {"url": self.url}
        if events:
            engine["events"] = self.events_endpoint
        if tier and self.lmcache_url:
            engine["lmcache"] = {
                "coordinator_url": self.lmcache_url,
                "server_url": self.lmcache_url,
                "model_name": model_name,
            }
        return engine


@dataclass(frozen=True, slots=True)
class Simulator(SimEndpoints):
    """An in-process simulator; ``engine`` gives tests direct access to the pool."""

    engine: SimEngine
    config: SimConfig


def _zmq_bind(host: str, port: int) -> str:
    wildcard = host in ("0.0.0.0", "*", "")
    return f"tcp://{'*' if wildcard else host}:{port if port else '*'}"


def _connect_form(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def create_app(engine: SimEngine, config: SimConfig, publisher: EventPublisher) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 2**20)
    tokenizer = SimTokenizer()
    app[ENGINE], app[TOKENIZER], app[MODEL] = engine, tokenizer, config.model
    app[REPLY] = tokenizer.encode(REPLY_TEXT)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, config.model))
    app[routes_misc.REGISTRY] = registry
    app[routes_misc.EVENT_SOURCES] = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
              "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000,
              "topic": config.topic}
    }  # fmt: skip
    routes_openai.add_routes(app)
    routes_responses.add_routes(app)
    routes_misc.add_routes(app)
    return app


async def _start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    # like vLLM's OpenAI server (its ``with_cancellation`` routes): a client that goes away
    # aborts its request, non-streaming ones included, so it frees its blocks and slot
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, int(bound)


@contextlib.asynccontextmanager
async def run_simulator(config: SimConfig) -> AsyncIterator[Simulator]:
    """Start the whole simulator on the running loop; stop it on exit."""
    publisher = EventPublisher(
        _zmq_bind(config.host, config.events_port),
        None if config.replay_port is None else _zmq_bind(config.host, config.replay_port),
        topic=config.topic,
    )
    engine = SimEngine(config.engine_config(), get_profile(config.profile), publisher.publish)
    runners: list[web.AppRunner] = []
    try:
        publisher.start()
        engine.start()
        runner, port = await _start_site(
            create_app(engine, config, publisher), config.host, config.port
        )
        runners.append(runner)
        lmcache_url = None
        if engine.cpu is not None:
            lm_app = create_lmcache_app(engine, config.model)
            lm_runner, lm_port = await _start_site(lm_app, config.host, config.lmcache_port)
            runners.append(lm_runner)
            lm_app[ADDRESS].update(ip=_http_host(config.host), http_port=lm_port)
            lmcache_url = f"http://{_http_host(config.host)}:{lm_port}"
        yield Simulator(
            url=f"http://{_http_host(config.host)}:{port}",
            events_endpoint=_connect_form(publisher.endpoint),
            replay_endpoint=_connect_form(publisher.replay_endpoint)
            if publisher.replay_endpoint
            else None,
            lmcache_url=lmcache_url,
            engine=engine,
            config=config,
        )
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        await engine.stop()
        await publisher.aclose()


def _http_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "*", "") else host


def endpoints_of(sim: Simulator) -> dict[str, Any]:
    return {
        "url": sim.url,
        "events_endpoint": sim.events_endpoint,
        "replay_endpoint": sim.replay_endpoint,
        "lmcache_url": sim.lmcache_url,
    }


async def serve_forever(config: SimConfig, *, announce: bool = True) -> None:
    """Run until cancelled; prints one ``KVKEEPER_SIM_READY {json}`` line once listening."""
    async with run_simulator(config) as sim:
        if announce:
            print(_READY + json.dumps(endpoints_of(sim)), flush=True)
        await asyncio.Event().wait()


def config_argv(config: SimConfig) -> list[str]:
    """``kvkeeper sim`` arguments reproducing ``config``."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if value is None:
            argv.append("--no-replay")
        else:
            argv += [flag, str(value)]
    return argv


@contextlib.asynccontextmanager
async def run_simulator_process(
    config: SimConfig, *, startup_timeout: float = 30.0
) -> AsyncIterator[SimEndpoints]:
    """Start ``kvkeeper sim`` as a child process (own event loop); stop it on exit."""
    argv = [sys.executable, "-m", "proxy.cli", "sim", *config_argv(config)]
    proc = await asyncio.create_subprocess_exec(
        *tied_to_parent(argv), stdout=asyncio.subprocess.PIPE
    )
    try:
        info = await asyncio.wait_for(_read_ready(proc), startup_timeout)
        yield SimEndpoints(**info)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _read_ready(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"simulator exited before it was ready (rc={proc.returncode})")
        text = line.decode()
        if text.startswith(_READY):
            info: dict[str, Any] = json.loads(text[len(_READY) :])
            return info
