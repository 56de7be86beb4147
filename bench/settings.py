"""The project's settings plus the peers that need a Django app (``make bench`` only),
and the private Redis servers ``bench/private_redis.py`` starts for the Redis scale
workload: a cluster whose grants wait for a replica (``redis-cluster-acked``), and
one server reached at four loopback addresses (``host-0`` to ``host-3``)."""

import os

from project.settings import *  # noqa: F403
from project.settings import CACHES, DJLOCKS, INSTALLED_APPS, REDIS_CLUSTER_URL

INSTALLED_APPS = [*INSTALLED_APPS, "db_mutex"]

if REDIS_CLUSTER_URL:
    DJLOCKS["BACKENDS"]["redis-cluster-acked"] = {
        "BACKEND": "djlocks.backends.redis.RedisBackend",
        "OPTIONS": {"cluster": REDIS_CLUSTER_URL, "wait_replicas": 1},
    }
for host, address in enumerate(filter(None, os.environ.get("DJLOCKS_BENCH_HOSTS", "").split())):
    CACHES[f"host-{host}"] = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://{address}/0",
    }
    DJLOCKS["BACKENDS"][f"host-{host}"] = {
        "BACKEND": "djlocks.backends.redis.RedisBackend",
        "OPTIONS": {"cache": f"host-{host}"},
    }
