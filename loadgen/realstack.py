"""The real stack: the LMCache multi-process server and vLLM-on-CPU engines beside it.

What ``kvkeeper demo --real`` and ``scripts/bench_realstack.py`` start: the LMCache MP stack
(``deploy/local/lmcache-stack.sh``: coordinator + MP server on free ports, an L1 of ``l1_gb``
GB, no L2), a vLLM (SmolLM2-135M, 32-token blocks, KV events) attached to it through
``LMCacheMPConnector`` and a second one alike without the connector. The engine venv and the
LMCache venv come from ``deploy/local/engine-setup.sh`` and ``deploy/local/lmcache-install.sh``.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.bench_compare import CompareSpec
from loadgen.runner import RunOptions
from loadgen.sim.server import SimConfig
from loadgen.workloads.hints import HintPolicy
from proxy.engine_cli import (
    SERVED_NAME,
    EngineSpec,
    engine_home,
    ensure_engine_installed,
    free_port,
    start_engine,
    stop_engine,
    wait_ready,
)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "local"
STACK_SCRIPT = DEPLOY / "lmcache-stack.sh"
SETUP_COMMANDS = ("bash deploy/local/engine-setup.sh", "bash deploy/local/lmcache-install.sh")
# The real-engine swarm (scripts/bench_realengine.py, scripts/bench_realstack.py): the 200-block
# pool holds 6,400 tokens; this swarm's peak working set is ~360 blocks, LRU keeps
# ~51% of prompt tokens, Belady ~63%, an infinite cache ~81% (planned ceilings). No prompt plus
# output exceeds the engine's 4,096-token context.
SWARM: dict[str, Any] = {
    "seed": 0,
    "users": 8,
    "agents": 5,
    "arrival_rate": 1.0,
    "token_scale": 0.5,
    "anchor_max": 5000,
    "min_dispatches": 3,
    "max_dispatches": 5,
    "pause_min": 3.0,
    "pause_cap": 15.0,
    "output_tokens": 48,
}
CONNECTOR_MODULE = "lmcache.integration.vllm.vllm_multi_process_adapter"


@dataclass(frozen=True, slots=True)
class Engine:
    url: str
    events: str


@dataclass(frozen=True, slots=True)
class Stack:
    """A running LMCache MP stack."""

    coordinator_url: str
    server_url: str
    mp_port: int

    def connector(self) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` attaching an engine to this stack."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.mp_port,
            },
        }

    def tier(self, model_dir: Path) -> dict[str, Any]:
        """kvkeeper's view of the stack as its offload tier (LMCache keys carry vLLM's --model)."""
        return {
            "coordinator_url": self.coordinator_url,
            "server_url": self.server_url,
            "model_name": str(model_dir),
        }


def missing() -> str | None:
    """What of the engine and LMCache venvs is not installed (None: all of it is), checked
    without installing anything."""
    home = engine_home()
    python = home / "venv" / "bin" / "python"
    if not python.exists() or not (home / "model" / "config.json").is_file():
        return f"no vLLM CPU engine venv and model under {home}"
    if not (home.parent / "lmcache" / "venv" / "bin" / "lmcache").exists():
        return f"no LMCache venv under {home.parent / 'lmcache'}"
    probe = [
        str(python),
        "-c",
        f"import importlib.util as u; assert u.find_spec({CONNECTOR_MODULE!r})",
    ]
    done = subprocess.run(probe, capture_output=True, timeout=120, check=False)
    if done.returncode != 0:
        return "no LMCache connector in the engine venv"
    return None


@contextmanager
def lmcache_stack(folder: Path, l1_gb: str) -> Iterator[Stack]:
    """Coordinator + MP server on free ports, stopped at the end."""
    ports = {name: free_port() for name in ("coord", "mp", "http", "prom")}
    env = dict(os.environ)
    env.update(
        LMCACHE_RUN_DIR=str(folder),
        LMCACHE_COORD_PORT=str(ports["coord"]),
        LMCACHE_MP_PORT=str(ports["mp"]),
        LMCACHE_HTTP_PORT=str(ports["http"]),
        LMCACHE_PROM_PORT=str(ports["prom"]),
        LMCACHE_L1_GB=l1_gb,
        LMCACHE_L2_ADAPTER="none",
    )
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", str(STACK_SCRIPT), "start"], env=env, check=True, timeout=300)
    try:
        yield Stack(
            f"http://127.0.0.1:{ports['coord']}", f"http://127.0.0.1:{ports['http']}", ports["mp"]
        )
    finally:
        subprocess.run(["bash", str(STACK_SCRIPT), "stop"], env=env, check=False, timeout=120)


@contextmanager
def vllm_engines(
    num_blocks: int, connectors: list[dict[str, Any] | None], eager: bool = False
) -> Iterator[list[Engine]]:
    """One vLLM per entry of ``connectors`` (None: no KV connector), started side by side and
    stopped at the end. ``eager``: ``--enforce-eager`` (no torch.compile at start-up, which vLLM
    redoes on every start; decoding runs uncompiled)."""
    python, model_dir = ensure_engine_installed()
    with ExitStack() as stack:
        started = []
        for connector in connectors:
            extra: tuple[str, ...] = ("--enforce-eager",) if eager else ()
            if connector is not None:
                extra += ("--kv-transfer-config", json.dumps(connector))
            spec = EngineSpec(
                port=free_port(),
                num_blocks=num_blocks,
                events_port=free_port(),
                extra_args=extra,
                extra_env={"LMCACHE_DISABLE_BANNER": "1"},
            )
            proc = start_engine(spec, python, model_dir)
            stack.callback(stop_engine, spec.port)
            started.append((spec, proc, connector))
        engines = []
        for spec, proc, connector in started:
            took = wait_ready(spec, proc, timeout=600)
            kind = "plain" if connector is None else "LMCache"
            print(f"vLLM ({kind}) ready in {took:.0f}s", flush=True)
            assert spec.events_endpoint is not None
            engines.append(Engine(spec.url, spec.events_endpoint))
        yield engines


def spec_for(
    out: Path,
    eng: Engine,
    targets: tuple[str, ...],
    lmcache: dict[str, Any] | None,
    blocks: int,
    concurrency: int = 16,
) -> CompareSpec:
    """A comparison of ``targets`` on the real engine ``eng`` (``lmcache``: its stack, kvkeeper's
    offload tier) with a ``blocks``-block pool."""
    return CompareSpec(
        out=out,
        targets=targets,
        engine_urls=(eng.url,),
        engine_events=(eng.events,),
        capacity_blocks=blocks - 1,  # block 0 is vLLM's null block
        sim=SimConfig(block_size=32),  # only its block size is read (retention)
        options=RunOptions(concurrency=concurrency, progress=False, request_timeout=600),
        hints=HintPolicy(),
        api="completions-ids",
        retention={"hash_seed": "0"},
        offload=lmcache is not None,
        engine_lmcache=lmcache,
        model=SERVED_NAME,
    )
