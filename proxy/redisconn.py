"""Opening the session store's Redis: one server, or a Sentinel-monitored master.

URLs: ``redis://``, ``rediss://``, ``unix://`` (redis-py's own), and
``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``: the master of
``service`` as the sentinels name it (the credentials are the master's), found again after a
failover (every new connection asks the sentinels); ``redis-cluster://[[user]:password@]host:port
[,host:port...]``: a Redis Cluster, found from any of these nodes (keys are hash-tagged per
tenant, so each script touches one slot: see proxy/store.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel://",)
CLUSTER_SCHEMES = ("redis-cluster://",)
SCHEMES = ("redis://", "rediss://", "unix://", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES)


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Raise ValueError with what is wrong."""
    scheme, _, rest = url.partition("://")
    auth, _, hosts_path = rest.rpartition("@")
    hosts, _, path = hosts_path.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2:
        raise ValueError(f"sentinel url must be {scheme}://host:port[,host:port]/service[/db]")
    sentinels = []
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"sentinel address {item!r} must be host:port")
        sentinels.append((host.strip("[]"), int(port)))
    if len(parts) == 2 and not parts[1].isdigit():
        raise ValueError(f"sentinel url database must be a number, got {parts[1]!r}")
    user, _, password = auth.partition(":") if auth else ("", "", "")
    return SentinelUrl(
        sentinels=sentinels,
        service=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
    )


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(nodes, username, password) of a ``redis-cluster://`` URL; ValueError when malformed."""
    rest = url.partition("://")[2].rstrip("/")
    auth, _, hosts = rest.rpartition("@")
    nodes = []
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"cluster node {item!r} must be host:port")
        nodes.append((host.strip("[]"), int(port)))
    user, _, password = auth.partition(":") if auth else ("", "", "")
    return nodes, unquote(user) or None, unquote(password) or None


def open_redis(url: str, **options: Any) -> Redis:
    """A client for ``url`` with ``options`` (timeouts, pool size) on every connection. For a
    cluster this is a ``RedisCluster`` (typed as Redis: the store uses what both offer)."""
    if url.startswith(CLUSTER_SCHEMES):
        nodes, username, password = parse_cluster_url(url)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in nodes],
            username=username,
            password=password,
            **options,
        )
        return cluster  # type: ignore[return-value]
    if not url.startswith(SENTINEL_SCHEMES):
        return Redis.from_url(url, **options)
    spec = parse_sentinel_url(url)
    sentinel = Sentinel(
        spec.sentinels,
        sentinel_kwargs={
            "socket_timeout": options.get("socket_timeout"),
            "socket_connect_timeout": options.get("socket_connect_timeout"),
        },
        **options,
    )
    master: Redis = sentinel.master_for(
        spec.service, db=spec.db, username=spec.username, password=spec.password
    )
    return master
