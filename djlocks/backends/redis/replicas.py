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
from redis import Redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import AskError, NoScriptError

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

    On a cluster the pipeline goes to the master that serves ``key``'s slot; if
    the slot has moved (``MOVED``/``ASK``), the client learns the cluster's map
    again and the call is made once more. Raises the script's error, or a
    ``redis`` exception when Redis cannot be reached.
    """
    for attempt in range(2):
        node = _node_serving(client, key)
        pipe = node.pipeline(transaction=False)
        pipe.evalsha(script.sha, 1, key, *args)
        pipe.wait(acknowledgement.replicas, ms(acknowledgement.timeout))
        reply, acknowledged = pipe.execute(raise_on_error=False)
        if isinstance(reply, NoScriptError):  # a restarted or new master: load it there
            node.script_load(script.script)
        elif isinstance(reply, AskError) and isinstance(client, RedisCluster) and not attempt:
            client.nodes_manager.initialize()
        elif isinstance(reply, Exception):
            raise reply
        else:
            return reply, int(acknowledged)
    raise reply


def _node_serving(client: Redis | RedisCluster, key: str) -> Redis:
    """The client of the one server that runs ``key``'s scripts."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        if node is None or node.redis_connection is None:
            client.nodes_manager.initialize()
            node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        connection: Redis = node.redis_connection
        return connection
    return client


def replicas_short(client: Redis | RedisCluster, wanted: int) -> list[str]:
    """Each master that has fewer than ``wanted`` replicas connected, as ``"<master>
    has N"`` (``INFO replication``'s ``connected_slaves``); on a cluster, every master."""
    if isinstance(client, RedisCluster):
        seen = {
            node.name: node.redis_connection.info("replication")
            for node in client.get_primaries()  # type: ignore[no-untyped-call]
        }
    else:
        seen = {"the master": client.info("replication")}
    return [
        f"{where} has {info.get('connected_slaves', 0)}"
        for where, info in seen.items()
        if int(info.get("connected_slaves", 0)) < wanted
    ]
