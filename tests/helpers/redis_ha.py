"""Real redis-server processes for the HA tests: a master with a replica and sentinels."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from tests.helpers.redis_server import free_port


def _wait(port: int, timeout_s: float = 10.0) -> None:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis on port {port} did not answer within {timeout_s}s")
    finally:
        client.close()


class Node:
    """One redis-server (or sentinel) process; ``kill()`` is kill -9."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.argv, self.port = argv, port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait(self.port)
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


class SentinelSet:
    """A master, one replica and three sentinels (quorum 2) watching them as ``service``."""

    def __init__(self, service: str = "kvk", down_after_ms: int = 500) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH: apt-get install -y redis-server")
        self.dir = Path(tempfile.mkdtemp(prefix="kvk-sentinel-"))
        self.service = service
        self.master_port, self.replica_port = free_port(), free_port()
        base = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.master = Node(
            [*base, "--port", str(self.master_port), "--dir", str(self.dir)], self.master_port
        )
        self.replica = Node(
            [
                *base,
                "--port",
                str(self.replica_port),
                "--dir",
                str(self.dir),
                "--replicaof",
                "127.0.0.1",
                str(self.master_port),
            ],
            self.replica_port,
        )
        self.sentinels: list[Node] = []
        for _ in range(3):
            port = free_port()
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {service} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} 5000\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
            self.sentinels.append(Node([exe, str(conf), "--sentinel"], port))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self) -> SentinelSet:
        try:
            self.master.start()
            self.replica.start()
            for s in self.sentinels:
                s.start()
        except BaseException:
            self.stop()
            raise
        return self

    def master_port_now(self) -> int:
        client = redis.Redis(port=self.sentinels[-1].port, socket_timeout=0.5)
        try:
            addr: Any = client.sentinel_get_master_addr_by_name(self.service)
            return int(addr[1])
        finally:
            client.close()

    def stop(self) -> None:
        for node in (*self.sentinels, self.replica, self.master):
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class ClusterSet:
    """A Redis Cluster of ``masters`` primaries (no replicas), slots spread evenly."""

    def __init__(self, masters: int = 3) -> None:
        exe = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if exe is None or cli is None:
            raise RuntimeError("redis-server/redis-cli not found: apt-get install -y redis-server")
        self.cli = cli
        self.dir = Path(tempfile.mkdtemp(prefix="kvk-cluster-"))
        self.nodes: list[Node] = []
        for _ in range(masters):
            port = free_port()
            while port + 10000 > 65535:  # a cluster node also listens on port + 10000
                port = free_port()
            argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(self.dir), "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", "2000"]  # fmt: skip
            self.nodes.append(Node(argv, port))

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> ClusterSet:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> ClusterSet:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        for node in self.nodes:
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                while client.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the cluster did not become ready")
                    time.sleep(0.1)
            finally:
                client.close()
        return self

    def keys_per_node(self, pattern: str) -> list[int]:
        counts = []
        for node in self.nodes:
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                counts.append(sum(1 for _ in client.scan_iter(pattern)))
            finally:
                client.close()
        return counts

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
