"""The servers behind a Redis backend's client, each by name: the one server, or a
Redis Cluster's masters and replicas (for what must be read from each of them, such
as their settings)."""

from __future__ import annotations

from urllib.parse import urlsplit

from redis import Redis
from redis.cluster import RedisCluster

THE_SERVER = "the server"


def servers(client: Redis | RedisCluster) -> dict[str, Redis]:
    """``{name: client of that server}``: ``THE_SERVER`` alone, or a cluster's masters by
    ``host:port`` (the cluster client's own connections to them)."""
    if not isinstance(client, RedisCluster):
        return {THE_SERVER: client}
    masters = client.get_primaries()  # type: ignore[no-untyped-call]
    return {master.name: client.get_redis_connection(master) for master in masters}


def cluster_replicas(client: RedisCluster, url: str) -> dict[str, Redis]:
    """A new client of each replica of the cluster, by ``host:port``, made from ``url``
    (a node's URL: its credentials and options serve every node). The cluster's own
    client knows only the masters; the caller closes these."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    return {
        address: Redis.from_url(
            parts._replace(netloc=f"{credentials}@{address}" if credentials else address).geturl()
        )
        for address, node in client.cluster_nodes().items()
        if "slave" in str(node["flags"]).split(",") and node.get("connected")
    }
