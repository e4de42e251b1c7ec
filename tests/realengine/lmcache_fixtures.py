"""The real LMCache MP stack beside a SECOND vLLM-on-CPU attached to it through LMCacheMPConnector.

Import the fixtures into a test module (``from tests.realengine.lmcache_fixtures import *``-style,
by name). ``lmcache_stack`` runs ``deploy/local/lmcache-stack.sh`` (coordinator + MP server) on
free ports with a private run/L2 folder; ``lmcache_vllm`` starts vLLM with a 200-block pool of
32-token blocks, prefix caching, ``PYTHONHASHSEED=0`` and dev mode, attached to that server.
Both live for the importing module only, so this engine does not idle beside the plain one
while other modules run (2 cores). ``_clean_prefix_cache`` overrides the conftest's autouse
fixture of that name in the importing module, so those tests reset THIS engine's prefix cache
(vLLM's own cache only: LMCache keeps its copies) and do not start the plain engine.

Setup: ``deploy/local/engine-setup.sh`` then ``deploy/local/lmcache-install.sh``; without the
LMCache venv or the connector in the engine venv the tests are skipped with that instruction.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.engine_cli import (
    SERVED_NAME,
    EngineError,
    EngineSpec,
    engine_home,
    ensure_engine_installed,
    free_port,
    run_dir,
    start_engine,
    stop_engine,
    wait_ready,
)

REPO = Path(__file__).resolve().parents[2]
STACK_SCRIPT = REPO / "deploy" / "local" / "lmcache-stack.sh"
START_TIMEOUT = float(os.environ.get("KVKEEPER_ENGINE_START_TIMEOUT", "420"))
NUM_BLOCKS = 200
BLOCK_SIZE = 32
CHUNK_SIZE = 256  # LMCache's chunk, fixed by the stack script


@dataclass(frozen=True, slots=True)
class LMCacheStack:
    """A running coordinator + MP server."""

    coordinator_url: str
    server_url: str
    mp_port: int
    l2_dir: Path
    run_dir: Path


@dataclass(frozen=True, slots=True)
class LMCacheVLLM:
    """The vLLM attached to the stack. ``model_dir`` is its ``--model`` (LMCache's model_name)."""

    url: str
    model_dir: str
    served_name: str
    num_blocks: int
    block_size: int
    log_path: Path
    stack: LMCacheStack


def _lmcache_home() -> Path:
    return engine_home().parent / "lmcache"


def _require_installed(engine_python: Path) -> None:
    """Skip (with the fix) when the LMCache venv or the connector is missing."""
    if not (_lmcache_home() / "venv" / "bin" / "lmcache").exists():
        pytest.skip("no LMCache venv: run deploy/local/lmcache-install.sh")
    probe = subprocess.run(
        [str(engine_python), "-c", "import importlib.util as u; "
         "assert u.find_spec('lmcache.integration.vllm.vllm_multi_process_adapter')"],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip("no LMCache connector in the engine venv: run deploy/local/lmcache-install.sh")


def _stack_env(ports: dict[str, int], folder: Path, l1_gb: str = "1") -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        LMCACHE_RUN_DIR=str(folder),
        LMCACHE_L2_DIR=str(folder / "l2"),
        LMCACHE_COORD_PORT=str(ports["coord"]),
        LMCACHE_MP_PORT=str(ports["mp"]),
        LMCACHE_HTTP_PORT=str(ports["http"]),
        LMCACHE_PROM_PORT=str(ports["prom"]),
        LMCACHE_L1_GB=l1_gb,
    )
    return env


@pytest.fixture(scope="session")
def lmcache_engine_python() -> tuple[Path, Path]:
    """(engine venv python, model dir), after checking LMCache is installed on both sides."""
    try:
        python, model_dir = ensure_engine_installed()
    except EngineError as exc:
        pytest.fail(f"engine venv/model setup failed: {exc}")
    _require_installed(python)
    return python, model_dir


@pytest.fixture(scope="module")
def lmcache_stack(
    lmcache_engine_python: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LMCacheStack]:
    """Coordinator + MP server on free ports, stopped (and their shared memory freed) at the end.
    The importing module may set ``LMCACHE_L1_GB`` (a string, default "1") for a smaller L1."""
    folder = tmp_path_factory.mktemp("lmcache")
    ports = {name: free_port() for name in ("coord", "mp", "http", "prom")}
    env = _stack_env(ports, folder, str(getattr(request.module, "LMCACHE_L1_GB", "1")))
    started = subprocess.run(
        ["bash", str(STACK_SCRIPT), "start"], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    try:
        if started.returncode != 0:
            pytest.fail(f"LMCache stack did not start:\n{started.stderr[-4000:]}")
        yield LMCacheStack(
            coordinator_url=f"http://127.0.0.1:{ports['coord']}",
            server_url=f"http://127.0.0.1:{ports['http']}",
            mp_port=ports["mp"],
            l2_dir=folder / "l2",
            run_dir=folder,
        )
    finally:
        subprocess.run(
            ["bash", str(STACK_SCRIPT), "stop"], env=env, capture_output=True, timeout=120,
            check=False,
        )  # fmt: skip
        shutil.rmtree(folder / "l2", ignore_errors=True)  # ~6 MB per chunk on disk


@pytest.fixture(scope="module")
def lmcache_vllm(
    lmcache_engine_python: tuple[Path, Path], lmcache_stack: LMCacheStack
) -> Iterator[LMCacheVLLM]:
    """A second vLLM (200 x 32-token blocks) storing to and loading from the stack."""
    python, model_dir = lmcache_engine_python
    connector = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache_stack.mp_port,
        },
    }
    spec = EngineSpec(
        port=free_port(),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        events_port=None,
        extra_args=("--kv-transfer-config", json.dumps(connector)),
        extra_env={"LMCACHE_DISABLE_BANNER": "1"},
    )
    proc = start_engine(spec, python, model_dir)
    try:
        wait_ready(spec, proc, START_TIMEOUT)
    except EngineError as exc:
        pytest.fail(f"vLLM with the LMCache connector did not start: {exc}")
    try:
        yield LMCacheVLLM(
            url=spec.url,
            model_dir=str(model_dir),
            served_name=SERVED_NAME,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            log_path=run_dir(spec.port)[1],
            stack=lmcache_stack,
        )
    finally:
        stop_engine(spec.port)


@pytest.fixture(autouse=True)
def _clean_prefix_cache(lmcache_vllm: LMCacheVLLM) -> None:
    """Each test starts with vLLM's own prefix cache empty (LMCache's tiers are untouched)."""
    req = urllib.request.Request(f"{lmcache_vllm.url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
