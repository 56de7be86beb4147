"""Private Redis servers around a benchmark: ``python -m bench.private_redis COMMAND ...``
starts a Redis Cluster (three masters with a replica each, ``tests/redis_cluster.py``)
and one redis-server that listens on four loopback addresses, 127.0.0.2 to
127.0.0.5 (four hosts' ways to one store: each host's processes connect to their
own address), runs ``COMMAND`` with ``DJLOCKS_REDIS_CLUSTER`` and
``DJLOCKS_BENCH_HOSTS`` (the four ``address:port``) set, stops the servers and
exits with the command's status. ``bench/settings.py`` turns them into backends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import redis

from tests.faults import free_port, until
from tests.redis_cluster import PrivateRedisCluster

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")


def main() -> int:
    home = tempfile.mkdtemp(prefix="djlocks-bench-redis-")
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", *HOSTS, "--save", "",
         "--appendonly", "no", "--dir", home, "--logfile", os.path.join(home, "log")],
    )  # fmt: skip
    cluster = None
    try:
        until(lambda: _answers(HOSTS[0], port), "the private redis-server to start")
        cluster = PrivateRedisCluster()
        env = {
            **os.environ,
            "DJLOCKS_REDIS_CLUSTER": cluster.url,
            "DJLOCKS_BENCH_HOSTS": " ".join(f"{host}:{port}" for host in HOSTS),
        }
        return subprocess.run(sys.argv[1:], env=env).returncode
    finally:
        if cluster is not None:
            cluster.stop()
        server.kill()
        server.wait(10)
        shutil.rmtree(home, ignore_errors=True)


def _answers(host: str, port: int) -> bool:
    try:
        return bool(redis.Redis(host=host, port=port).ping())
    except redis.ConnectionError:
        return False


if __name__ == "__main__":
    sys.exit(main())
