"""Waiting for replicas to acknowledge a grant or a renewal (Redis ``WAIT``).

Redis replicates asynchronously: a master that dies before its replica received
a grant leaves the name free on the promoted replica while the holder believes
it holds it. With ``OPTIONS["wait_replicas"]`` set, each script that grants or
renews is sent together with ``WAIT numreplicas timeout`` on the same connection
(one pipeline, one round trip): ``WAIT`` blocks until that many replicas have
every write this connection made, or the time-out passes, and says how many did
(the Redis manual's ``WAIT``). A grant or renewal that fewer replicas have is
not counted: the grant is given back, the renewal is retried.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from redis import Redis, exceptions
from redis.cluster import RedisCluster
from redis.commands.core import Script

from djlocks.backends.redis.nodes import servers
from djlocks.backends.redis.protocol import ms

#: Seconds a grant or renewal waits for its replicas by default.
DEFAULT_WAIT_TIMEOUT = 0.5


@dataclass(frozen=True)
class Acknowledgement:
    """How many replicas must have a grant or renewal (``replicas``; 0: none, Redis's
    own asynchronous replication) within ``timeout`` seconds."""

    replicas: int = 0
    timeout: float = DEFAULT_WAIT_TIMEOUT

    @classmethod
    def from_options(cls, alias: str, options: Mapping[str, Any]) -> Acknowledgement:
        """From ``OPTIONS["wait_replicas"]`` and ``OPTIONS["wait_timeout"]``; raises
        ``ImproperlyConfigured`` for a count that is not a whole number >= 0 or a
        time-out that is not a positive, finite number of seconds."""
        replicas = options.get("wait_replicas", 0)
        timeout = options.get("wait_timeout", DEFAULT_WAIT_TIMEOUT)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ImproperlyConfigured(
                f"djlocks backend {alias!r}: OPTIONS['wait_replicas'] must be a whole number "
                f"of replicas, 0 (do not wait) or more, not {replicas!r}."
            )
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise ImproperlyConfigured(
                f"djlocks backend {alias!r}: OPTIONS['wait_timeout'] must be a positive number "
                f"of seconds (how long a grant or renewal waits for its replicas), not "
                f"{timeout!r}."
            )
        return cls(replicas, float(timeout))

    def __bool__(self) -> bool:
        return self.replicas > 0


#: What makes a call on a cluster learn the cluster's map again and try once more: a
#: slot that moved, a master that is gone or not yet replaced.
MAP_CHANGED = (
    exceptions.MovedError,
    exceptions.ClusterDownError,
    exceptions.TryAgainError,
    exceptions.ConnectionError,
    exceptions.TimeoutError,
)
ATTEMPTS = 3  # the map learnt again, then the script loaded on a newly promoted master


def run_and_wait(
    client: Redis | RedisCluster,
    script: Script,
    key: str,
    args: Sequence[str | int],
    acknowledgement: Acknowledgement,
) -> tuple[Any, int]:
    """Run ``script`` on ``key`` and ``WAIT`` for its replicas, in one round trip on
    one connection (``WAIT`` counts the writes of the connection it is sent on);
    return the script's reply and how many replicas acknowledged.

    A master that lacks the script (restarted, or newly promoted) loads it. On a
    cluster the pipeline goes to the master that serves ``key``'s slot, bypassing
    the cluster client's routing, so this does what the client would: when the
    slot has moved or its master is gone (``MAP_CHANGED``), it learns the map again
    and tries once more. A slot being migrated (``ASK``) is not followed. Raises
    the script's or ``WAIT``'s error, or a ``redis`` exception when Redis cannot
    be reached.
    """
    for attempt in range(1, ATTEMPTS + 1):
        node = _node_serving(client, key)
        pipe = node.pipeline(transaction=False)
        pipe.evalsha(script.sha, 1, key, *args)
        pipe.wait(acknowledgement.replicas, ms(acknowledgement.timeout))
        try:
            reply, acknowledged = pipe.execute(raise_on_error=False)
        except MAP_CHANGED:
            if not isinstance(client, RedisCluster) or attempt == ATTEMPTS:
                raise
            client.nodes_manager.initialize()
            continue
        if isinstance(reply, exceptions.NoScriptError) and attempt < ATTEMPTS:
            node.script_load(script.script)
        elif isinstance(reply, MAP_CHANGED) and isinstance(client, RedisCluster):
            if attempt == ATTEMPTS:
                raise reply
            client.nodes_manager.initialize()
        elif isinstance(reply, Exception):
            raise reply
        elif isinstance(acknowledged, Exception):
            raise acknowledged  # WAIT refused: sent to a replica, or denied by an ACL
        else:
            return reply, int(acknowledged)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _node_serving(client: Redis | RedisCluster, key: str) -> Redis:
    """The client of the one server that runs ``key``'s scripts."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return client.get_redis_connection(node)
    return client


def replicas_short(client: Redis | RedisCluster, wanted: int) -> list[str]:
    """Each master that has fewer than ``wanted`` replicas connected, as ``"<master>
    has N"`` (``INFO replication``'s ``connected_slaves``, which also counts a replica
    still making its first copy); on a cluster, every master."""
    seen = {where: server.info("replication") for where, server in servers(client).items()}
    return [
        f"{where} has {info.get('connected_slaves', 0)}"
        for where, info in seen.items()
        if int(info.get("connected_slaves", 0)) < wanted
    ]
