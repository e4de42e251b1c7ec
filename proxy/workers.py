"""``kvkeeper serve --workers N``: N processes, each one aiohttp app on its own event loop, all
accepting on one port (SO_REUSEPORT: the kernel spreads connections over them).

They share one Redis (the embedded one is started here, once, when no URL is given), so sessions,
the per-engine retention lease (one holder per engine across all processes) and the shared prefix
index (``proxy/prefix_share.py``) are common. Metrics are prometheus_client's multiprocess mode:
each worker writes its counters to files in one folder and every worker's /metrics sums them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as MPEvent
from pathlib import Path
from typing import Any

from proxy.settings import Settings

log = logging.getLogger("kvkeeper.workers")

MAX_DEFAULT_WORKERS = 4
CGROUP_ROOT = Path("/sys/fs/cgroup")  # the container's own cgroup (cgroup namespaces)
RESTART_BACKOFF_S = 1.0


def worker_count(asked: int | None, cgroup_root: Path = CGROUP_ROOT) -> int:
    """``asked``, else the cores this process may run on (its CPU quota's, in a container
    that has one), at most ``MAX_DEFAULT_WORKERS``."""
    if asked is not None:
        return asked
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs this process's cgroup may use (a container's CPU limit), None when unlimited or
    unknown: cgroup v2's ``cpu.max``, else v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        v1 = root / "cpu"
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def probe_port(host: str, port: int) -> None:
    """Raise the OSError binding ``host:port`` as the workers will (SO_REUSEPORT) would raise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))


# a worker process's entry: (the settings the parent resolved, dumped; the event to set once it
# listens). A module-level function, so a spawned interpreter can import it.
WorkerEntry = Callable[[dict[str, Any], MPEvent], None]


class Supervisor:
    """Starts the workers, restarts one that dies after start-up, stops them all on a signal."""

    def __init__(
        self, settings: Settings, count: int, announce: Callable[[], None], entry: WorkerEntry
    ) -> None:
        self.settings = settings
        self.entry = entry
        self.count = count
        self.announce = announce
        self.ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no inherited loop
        self.procs: list[tuple[SpawnProcess, MPEvent]] = []
        self.stopping = threading.Event()

    def _start(self, dump: dict[str, Any]) -> tuple[SpawnProcess, MPEvent]:
        ready = self.ctx.Event()
        proc = self.ctx.Process(target=self.entry, args=(dump, ready), name="kvkeeper-worker")
        proc.start()
        return proc, ready

    def run(self) -> int:
        # read by prometheus_client when the workers import it (they inherit the environment);
        # an operator's own folder is kept, one of ours removed at the end
        given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        metrics_dir = given or tempfile.mkdtemp(prefix="kvkeeper-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        embedded = None
        settings = self.settings
        try:
            if settings.redis_url is None:
                from proxy.embedded import EmbeddedRedis

                embedded = EmbeddedRedis()
                url = asyncio.run(embedded.start())
                settings = settings.model_copy(update={"redis_url": url})
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stopping.set())
            dump = settings.model_dump(mode="json")
            self.procs = [self._start(dump) for _ in range(self.count)]
            code = self._wait_ready()
            if code is not None:
                return code
            self.announce()
            self._watch(dump, metrics_dir)
            return 0
        finally:
            self._stop_all()
            if embedded is not None:
                asyncio.run(embedded.stop())
            if not given:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
                shutil.rmtree(metrics_dir, ignore_errors=True)

    def _wait_ready(self) -> int | None:
        """None once every worker listens; else the exit code of one that failed to start."""
        while not all(ready.is_set() for _, ready in self.procs):
            for proc, ready in self.procs:
                if not ready.is_set() and not proc.is_alive():
                    return proc.exitcode or 1
            if self.stopping.wait(0.05):
                return 0
        return None

    def _watch(self, dump: dict[str, Any], metrics_dir: str) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        while not self.stopping.wait(0.2):
            for i, (proc, _) in enumerate(self.procs):
                if proc.is_alive():
                    continue
                log.warning("worker %s exited (%s); starting another", proc.pid, proc.exitcode)
                if proc.pid is not None:
                    mark_process_dead(proc.pid, metrics_dir)  # type: ignore[no-untyped-call]
                time.sleep(RESTART_BACKOFF_S)
                self.procs[i] = self._start(dump)

    def _stop_all(self, grace_s: float = 30.0) -> None:
        """SIGTERM (each worker drains like a single process does), then SIGKILL at the grace."""
        for proc, _ in self.procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc, _ in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
