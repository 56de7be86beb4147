"""A private Redis master, its replicas and three Sentinels on loopback, for the
fail-over tests: the Redis backend reaches the master through django-redis's
Sentinel client, which asks the Sentinels where the master is."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.faults import free_ports, until

SENTINELS = 3


class PrivateRedisSentinel:
    """A master and ``replicas`` replicas watched by ``SENTINELS`` Sentinels, which fail
    a master over once a majority has not heard from it for ``down_after`` seconds."""

    def __init__(self, down_after: float = 1.0, replicas: int = 1) -> None:
        self._home = Path(tempfile.mkdtemp(prefix="djlocks-redis-sentinel-"))
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        master, *ports = free_ports(1 + replicas + SENTINELS)
        self.replica_ports, self.sentinel_ports = ports[:replicas], ports[replicas:]
        #: The name the Sentinels know the master by: one of its own per set-up, since
        #: django-redis keeps its connection pools by URL for the life of the process.
        self.service = f"djlocks-{master}"
        try:
            self._start_all(master, down_after)
        except BaseException:
            self.stop()
            raise

    def _start_all(self, master: int, down_after: float) -> None:
        self._start(master)
        for replica in self.replica_ports:
            self._start(replica, "--replicaof", "127.0.0.1", str(master))
            until(lambda port=replica: self._synced(port, master), "the replica to sync")
        for port in self.sentinel_ports:
            config = self._home / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self._home}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {master} 2\n"
                f"sentinel down-after-milliseconds {self.service} {round(down_after * 1000)}\n"
                f"sentinel failover-timeout {self.service} 10000\n"
            )
            self._processes[port] = subprocess.Popen(
                ["redis-server", str(config), "--sentinel"], stdout=subprocess.DEVNULL
            )
        until(self._sentinels_know_each_other, "the Sentinels to find each other and the replicas")

    def _start(self, port: int, *options: str) -> None:
        directory = self._home / str(port)
        directory.mkdir()
        self._processes[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
             "--save", "", "--appendonly", "no", *options],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        until(lambda: self.cli(port, "PING") == "PONG", "a Redis to start")

    def _synced(self, replica: int, master: int) -> bool:
        """Whether ``replica``'s link is up and the master counts it online (only then
        does ``WAIT`` count it: after its first acknowledgement)."""
        return "master_link_status:up" in self.cli(replica, "INFO", "replication") and (
            f"port={replica},state=online" in self.cli(master, "INFO", "replication")
        )

    def cli(self, port: int, *command: str) -> str:
        """``redis-cli`` on the server or Sentinel at ``port``: its output, stripped."""
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *command], capture_output=True, text=True
        )
        return done.stdout.strip()

    def _sentinels_know_each_other(self) -> bool:
        for port in self.sentinel_ports:
            master = self.cli(port, "SENTINEL", "MASTER", self.service).splitlines()
            fields = dict(zip(master[::2], master[1::2], strict=False))
            if fields.get("num-slaves") != str(len(self.replica_ports)):
                return False
            if fields.get("num-other-sentinels") != str(SENTINELS - 1):
                return False
        return True

    def master(self) -> int:
        """The port of the master, as the Sentinels see it now."""
        address = self.cli(
            self.sentinel_ports[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
        )
        return int(address.splitlines()[1])

    def cache(self) -> dict[str, Any]:
        """A ``CACHES`` entry: django-redis's Sentinel client for the master."""
        return {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://{self.service}/0",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": [("127.0.0.1", port) for port in self.sentinel_ports],
            },
        }

    def kill(self, port: int) -> None:
        """SIGKILL the server at ``port``."""
        self._processes[port].kill()
        self._processes[port].wait(10)

    def hand_over(self) -> None:
        """Ask the Sentinels to promote the replica now (``SENTINEL FAILOVER``)."""
        answer = self.cli(self.sentinel_ports[0], "SENTINEL", "FAILOVER", self.service)
        assert answer == "OK", answer

    def stop(self) -> None:
        for process in self._processes.values():
            process.kill()
            process.wait(10)
        shutil.rmtree(self._home, ignore_errors=True)
