"""The servers behind a Redis backend's client, each by name: the one server, or a
Redis Cluster's masters and replicas (for what must be read from each of them, such
as their settings)."""

from __future__ import annotations

from urllib.parse import urlsplit

from redis import Redis
from redis.cluster import RedisCluster

THE_SERVER = "the server"
REPLICA_TIMEOUT = 5.0  # seconds a replica has to answer a check (unless its URL says)


def servers(client: Redis | RedisCluster) -> dict[str, Redis]:
    """``{name: client of that server}``: ``THE_SERVER`` alone, or a cluster's masters by
    ``host:port`` (the cluster client's own connections to them)."""
    if not isinstance(client, RedisCluster):
        return {THE_SERVER: client}
    masters = client.get_primaries()  # type: ignore[no-untyped-call]
    return {master.name: client.get_redis_connection(master) for master in masters}


def cluster_replicas(client: RedisCluster, url: str) -> dict[str, Redis]:
    """A new client of each connected replica of the cluster, by ``host:port`` (from
    ``CLUSTER NODES``), made from ``url`` (a node's URL: its credentials and options
    serve every node). redis-py's cluster client keeps only the masters unless it
    reads from replicas; the caller closes these."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    replicas = {}
    for address, node in client.cluster_nodes().items():
        if "slave" not in str(node["flags"]).split(",") or not node.get("connected"):
            continue
        host, _, port = address.rpartition(":")
        netloc = f"[{host}]:{port}" if ":" in host else address  # an IPv6 address
        replicas[address] = Redis.from_url(  # the URL's own time-outs, if any, win
            parts._replace(netloc=f"{credentials}@{netloc}" if credentials else netloc).geturl(),
            socket_timeout=REPLICA_TIMEOUT,
            socket_connect_timeout=REPLICA_TIMEOUT,
        )
    return replicas
