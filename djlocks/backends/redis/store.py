"""The Redis backend's connection (django-redis's client of a cache, or redis-py's
``RedisCluster``), scripts and checks."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection, Mapping
from typing import Any

from django.core import checks
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from redis import Redis
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import parse_url
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from djlocks.backends.base import LockBackend
from djlocks.backends.push import RedisListener
from djlocks.backends.redis.nodes import cluster_replicas, servers
from djlocks.backends.redis.protocol import PREFIX_CHARACTERS, SCRIPTS, script_source
from djlocks.backends.redis.replicas import Acknowledgement, replicas_short, run_and_wait
from djlocks.backends.redis.script_connections import ScriptConnections, one_address_pool
from djlocks.backends.redis.wakeups import WakeListener
from djlocks.conf import djlocks_settings
from djlocks.exceptions import BackendUnavailable
from djlocks.forksafe import fork_safe_lock
from djlocks.keys import redis_meta_key

#: What redis-py raises when the store cannot do what was asked: a cluster's client
#: raises ``RedisClusterException`` (not a ``RedisError``) when it finds no node.
STORE_ERRORS = (RedisError, RedisClusterException)


class RedisStore(LockBackend):
    """The client, the registered scripts, and the listeners of one Redis backend.

    OPTIONS: ``cache`` (a ``CACHES`` alias whose backend is django-redis,
    default ``"default"``), or ``cluster`` (the URL of any node of a Redis
    Cluster, ``redis://host:port/0``, or a list of such URLs, tried in turn, through
    redis-py's ``RedisCluster``, which finds the other nodes and follows the
    cluster's changes); ``prefix`` (key
    prefix, default ``DJLOCKS["KEY_PREFIX"]``); ``wait_replicas`` (how many replicas
    must have each grant and renewal, Redis ``WAIT``; default 0, do not wait) and
    ``wait_timeout`` (seconds they have to, default 0.5; see ``replicas``).
    """

    option_names = frozenset({"cache", "cluster", "prefix", "wait_replicas", "wait_timeout"})

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.cache: str = self.options.get("cache", "default")
        self.cluster = _cluster_urls(alias, self.options.get("cluster"))
        if self.cluster and "cache" in self.options:
            raise ImproperlyConfigured(
                f"djlocks backend {alias!r}: give OPTIONS['cache'] (a django-redis cache) or "
                f"OPTIONS['cluster'] (a Redis Cluster node's URL), not both."
            )
        self.acknowledgement = Acknowledgement.from_options(alias, self.options)
        self.prefix: str = self.options.get("prefix") or djlocks_settings()["KEY_PREFIX"]
        if not self.prefix or not set(self.prefix) <= PREFIX_CHARACTERS:
            raise ImproperlyConfigured(
                f"djlocks backend {alias!r}: the Redis key prefix {self.prefix!r} must be "
                f"non-empty letters, digits and '_.-:' (no braces or glob characters)."
            )
        self._client: Redis | RedisCluster | None = None
        self._client_guard = fork_safe_lock()
        self._scripts: dict[str, Script] = {}
        #: Set with the client: ``None`` where ``script_connections`` does not serve it.
        self._script_connections: ScriptConnections | None = None
        self._wakeups = WakeListener(self.redis, self.prefix)
        #: Where forced releases and graceful releases' requests tell holders (``watch``).
        self.revocations = f"{self.prefix}:revoked"
        self._revocations = RedisListener(self.redis, self.revocations)

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """When Django asks about databases: E008 a cache that is not django-redis,
        W005 Redis cannot be reached, W004 an eviction policy that may delete leases,
        W008 fewer replicas connected than ``wait_replicas`` asks for."""
        if databases is None:
            return []
        try:
            return [*self._eviction_messages(), *self._replica_messages()]
        except ImproperlyConfigured as exc:
            hint = (
                "Set OPTIONS['cluster'] to a Redis Cluster node's URL, redis://host:port/0"
                if self.cluster
                else "Point OPTIONS['cache'] at a CACHES alias whose BACKEND is "
                "'django_redis.cache.RedisCache'"
            )
            return [Error(str(exc), hint=hint + ".", id="djlocks.E008")]
        except (*STORE_ERRORS, BackendUnavailable) as exc:
            return [
                checks.Warning(
                    f"djlocks backend {self.alias!r} cannot reach Redis: {exc}",
                    hint="Start redis-server, or fix the cluster's URL."
                    if self.cluster
                    else "Start redis-server, or fix the cache's LOCATION.",
                    id="djlocks.W005",
                )
            ]

    def _eviction_messages(self) -> list[CheckMessage]:
        """W004 for each server (on a cluster, each node: a replica can be promoted)
        whose ``maxmemory-policy`` evicts keys."""
        client = self.redis()
        policies = {where: _eviction_policy(server) for where, server in servers(client).items()}
        if isinstance(client, RedisCluster):
            for where, replica in cluster_replicas(client, self.cluster[0]).items():
                with contextlib.suppress(*STORE_ERRORS):  # unreachable: its policy is unknown
                    policies[where] = _eviction_policy(replica)
                replica.close()
        evicting = [
            f"{where}: {policy}" if self.cluster else str(policy)
            for where, policy in policies.items()
            if policy not in (None, "noeviction")
        ]
        if not evicting:
            return []
        return [
            checks.Warning(
                f"djlocks backend {self.alias!r}: Redis evicts keys (maxmemory-policy "
                f"{', '.join(evicting)}) when it is full, and an evicted lease is a lock "
                f"granted twice.",
                hint="Set maxmemory-policy noeviction (on every node of a cluster), or give "
                "locks a Redis of their own.",
                id="djlocks.W004",
            )
        ]

    def _replica_messages(self) -> list[CheckMessage]:
        if not self.acknowledgement:
            return []
        short = replicas_short(self.redis(), self.acknowledgement.replicas)
        if not short:
            return []
        return [
            checks.Warning(
                f"djlocks backend {self.alias!r} waits for {self.acknowledgement.replicas} "
                f"replica(s) to acknowledge each grant and renewal, but {', '.join(short)} "
                f"connected: a name on a master with too few cannot be granted (acquires "
                f"raise BackendUnavailable), and its holder loses it.",
                hint="Connect the replicas, or lower OPTIONS['wait_replicas'].",
                id="djlocks.W008",
            )
        ]

    def redis(self) -> Redis | RedisCluster:
        """The client (thread-safe, pooled): of the cluster ``OPTIONS["cluster"]``, else
        django-redis's of the cache ``OPTIONS["cache"]``."""
        with self._client_guard:
            if self._client is None:
                client = self._cluster_client() if self.cluster else self._cache_client()
                self._scripts = {
                    name: client.register_script(script_source(name)) for name in SCRIPTS
                }
                pool = one_address_pool(client)
                self._script_connections = None if pool is None else ScriptConnections(pool)
                self._client = client
            return self._client

    @property
    def on_a_cluster(self) -> bool:
        """Whether the store is a Redis Cluster (whose pipelines run no scripts)."""
        return bool(self.cluster)

    def _cluster_client(self) -> RedisCluster:
        """A client of the cluster (djlocks' own: ``close_client`` closes it), which starts
        from the first node of ``OPTIONS["cluster"]`` that answers."""
        seeds = [_node_of(url) for url in self.cluster]
        try:  # the URL gives every node's options; the seeds are tried in their order
            return RedisCluster(url=self.cluster[0], startup_nodes=seeds)
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def close_client(self) -> None:
        """Close a cluster's client, which djlocks made (a cache's client is django-redis's,
        shared with the cache, and stays open: its kept connections go back to its pool)."""
        with self._client_guard:
            client, self._client = self._client, None
            kept, self._script_connections = self._script_connections, None
        if kept is not None:
            kept.give_back()
        if isinstance(client, RedisCluster):
            client.close()

    def _cache_client(self) -> Redis:
        from django_redis import get_redis_connection

        try:
            client: Redis = get_redis_connection(self.cache)
            return client
        except NotImplementedError as exc:
            raise ImproperlyConfigured(
                f"djlocks backend {self.alias!r} needs CACHES[{self.cache!r}] to use "
                f"django-redis ('django_redis.cache.RedisCache'): {exc}"
            ) from exc
        except Exception as exc:  # django's InvalidCacheBackendError and friends
            raise ImproperlyConfigured(
                f"djlocks backend {self.alias!r}: CACHES[{self.cache!r}] cannot be used: {exc}"
            ) from exc

    def _run(self, script: str, name: str, *args: str | int) -> Any:
        """Run ``script`` on the keys of ``name``; Redis errors become ``BackendUnavailable``."""
        return self._call(script, redis_meta_key(self.prefix, name), *args)

    def _call(self, script: str, meta_key: str, *args: str | int) -> Any:
        """Run ``script`` on ``meta_key``: over a kept connection where
        ``script_connections`` serves the client, else through the client."""
        try:
            self.redis()
            kept = self._script_connections
            if kept is None:
                return self._scripts[script](keys=[meta_key], args=list(args))
            return kept.run_script(self._scripts[script], meta_key, args)
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def _run_acknowledged(self, script: str, name: str, *args: str | int) -> tuple[Any, int]:
        """Run ``script`` on the keys of ``name`` and wait for ``wait_replicas`` replicas to
        have its writes (``replicas.run_and_wait``); return its reply and how many did.
        Without ``wait_replicas``, as ``_run``, with no replica counted."""
        if not self.acknowledgement:
            return self._run(script, name, *args), 0
        try:
            return run_and_wait(
                self.redis(),
                self._scripts[script],
                redis_meta_key(self.prefix, name),
                args,
                self.acknowledgement,
            )
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def unacknowledged(self, what: str, acknowledged: int) -> BackendUnavailable | None:
        """The error for ``what`` (a grant or renewal) that only ``acknowledged`` replicas
        have, or ``None`` if enough do."""
        wanted = self.acknowledgement
        if acknowledged >= wanted.replicas:
            return None
        return BackendUnavailable(
            f"djlocks backend {self.alias!r}: {what} reached {acknowledged} of the "
            f"{wanted.replicas} replica(s) OPTIONS['wait_replicas'] asks for within "
            f"{wanted.timeout:g} s (OPTIONS['wait_timeout']). Are the replicas connected "
            f"and keeping up? (`manage.py check --database default` counts them.)"
        )

    def _unavailable(self, exc: Exception) -> BackendUnavailable:
        said = f"{str(exc).rstrip('.')}."
        where = (
            f"the Redis Cluster at {_shown(self.cluster)}): {said} Are its nodes running "
            f"and reachable?"
            if self.cluster
            else f"cache {self.cache!r}): {said} Is redis-server running and reachable at "
            f"the cache's LOCATION?"
        )
        return BackendUnavailable(f"djlocks backend {self.alias!r} could not use Redis ({where}")


def _eviction_policy(server: Redis) -> str | None:
    """The server's ``maxmemory-policy``; ``None`` if ``CONFIG`` is disabled (a managed
    Redis), where it cannot be read."""
    try:
        policy: str | None = server.config_get("maxmemory-policy").get("maxmemory-policy")
        return policy
    except ResponseError:
        return None


def _cluster_urls(alias: str, option: object) -> tuple[str, ...]:
    """``OPTIONS["cluster"]`` as a tuple of node URLs (empty: not a cluster); raises
    ``ImproperlyConfigured`` for anything else, a URL a cluster cannot use, or URLs
    that differ in more than host and port (the cluster's client uses one set of
    credentials and options for every node)."""
    if option is None:
        return ()
    urls = (option,) if isinstance(option, str) else option
    if (
        not isinstance(urls, list | tuple)
        or not urls
        or not all(isinstance(url, str) and url for url in urls)
    ):
        shown = (
            [_shown(url) if isinstance(url, str) else url for url in urls]
            if isinstance(urls, list | tuple)
            else type(option).__name__
        )
        raise ImproperlyConfigured(
            f"djlocks backend {alias!r}: OPTIONS['cluster'] must be a Redis Cluster node's "
            f"URL (redis://host:port/0) or a non-empty list of them, not {shown!r}."
        )
    options = [_cluster_options(alias, url) for url in urls]
    for url, other in zip(urls[1:], options[1:], strict=True):
        if other != options[0]:
            raise ImproperlyConfigured(
                f"djlocks backend {alias!r}: OPTIONS['cluster'] has {_shown(url)}, which "
                f"differs from {_shown(urls[0])} in more than host and port: the cluster's "
                f"client uses one set of credentials and options for every node."
            )
    return tuple(urls)


def _cluster_options(alias: str, url: str) -> dict[str, Any]:
    """What ``url`` says besides its host and port (database 0 when it says none);
    raises ``ImproperlyConfigured`` for a URL a cluster cannot use."""
    try:
        parsed = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        problem = str(exc)
    else:
        problem = (
            "a Unix socket cannot reach a cluster"
            if "path" in parsed
            else "a cluster has database 0 only"
            if parsed.get("db", 0) != 0
            else ""
        )
    if problem:
        raise ImproperlyConfigured(
            f"djlocks backend {alias!r}: OPTIONS['cluster'] has {_shown(url)}: "
            f"{problem.rstrip('.')}. Give redis://host:port/0 (rediss:// for TLS)."
        )
    return {"db": 0, **{k: v for k, v in parsed.items() if k not in ("host", "port")}}


def _node_of(url: str) -> ClusterNode:
    """The cluster node ``url`` names (a URL ``_cluster_urls`` accepted)."""
    parsed = parse_url(url)  # type: ignore[no-untyped-call]
    return ClusterNode(parsed["host"], parsed.get("port", 6379))  # type: ignore[no-untyped-call]


def _shown(urls: str | tuple[str, ...]) -> str:
    """``urls`` without their passwords, for messages."""
    text = urls if isinstance(urls, str) else ", ".join(urls)
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", text)
