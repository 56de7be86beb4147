"""A private Redis Cluster on loopback (``PrivateRedisCluster``, also used by the
fail-over tests), and a test run around one: ``python -m tests.redis_cluster
COMMAND ...`` starts three masters and three replicas (``redis-server
--cluster-enabled yes`` on six free ports, joined by ``redis-cli --cluster
create``), runs ``COMMAND`` with ``DJLOCKS_REDIS_CLUSTER`` set to one node's URL
(project/settings.py then configures the ``redis-cluster`` backend, which the
lease tests take up), stops the cluster and exits with the command's status.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from djlocks.backends.redis.nodes import servers
from tests.faults import free_ports, until

MASTERS = 3
#: Times a cluster is started afresh, on other ports, when a node exits as it starts
#: (a port taken meanwhile by another process).
STARTS = 3


class PrivateRedisCluster:
    """``MASTERS`` masters with one replica each, in a directory of their own. A node
    that cannot reach a master for ``node_timeout`` seconds votes it down (Redis's
    ``cluster-node-timeout``), and its replica takes over."""

    def __init__(self, node_timeout: float = 15.0) -> None:
        self._node_timeout_ms = round(node_timeout * 1000)
        for start in range(1, STARTS + 1):
            self._home = Path(tempfile.mkdtemp(prefix="djlocks-redis-cluster-"))
            ports = free_ports(4 * MASTERS)  # each node's, then each node's cluster bus's
            self.ports, self._bus_ports = ports[: 2 * MASTERS], ports[2 * MASTERS :]
            self._nodes: list[subprocess.Popen[bytes]] = []
            try:
                self._start()
                return
            except NodeExited:
                self.stop()
                if start == STARTS:
                    raise
            except BaseException:
                self.stop()
                raise

    def _start(self) -> None:
        for port, bus_port in zip(self.ports, self._bus_ports, strict=True):
            directory = self._home / str(port)
            directory.mkdir()
            self._nodes.append(
                subprocess.Popen(
                    self._command(port, bus_port, directory), stdout=subprocess.DEVNULL
                )
            )
        for port, node in zip(self.ports, self._nodes, strict=True):
            until(lambda port=port, node=node: self._answers(port, node), "a node to start")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True,
        )  # fmt: skip
        until(self._serves_every_slot, "the cluster to serve every slot")
        until(self._replicas_in_sync, "every replica to sync with its master")

    def _answers(self, port: int, node: subprocess.Popen[bytes]) -> bool:
        """Whether the node at ``port`` answers; ``NodeExited`` at once if it exited."""
        if node.poll() is not None:
            raise NodeExited(f"redis-server on port {port} exited")
        return self.cli(port, "PING") == "PONG"

    def _command(self, port: int, bus_port: int, directory: Path) -> list[str]:
        """The node's command line. Its cluster bus gets a free port of its own: by
        default it is ``port`` + 10000, which may be taken, or above 65535."""
        return [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(bus_port),
            "--cluster-node-timeout", str(self._node_timeout_ms),
            "--dir", str(directory), "--save", "", "--appendonly", "no",
            "--logfile", str(directory / "log"),
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def cli(self, port: int, *command: str) -> str:
        """``redis-cli`` on the node at ``port``: its output, stripped."""
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *command], capture_output=True, text=True
        )
        return done.stdout.strip()

    def _serves_every_slot(self) -> bool:
        return all("cluster_state:ok" in self.cli(port, "CLUSTER", "INFO") for port in self.ports)

    def _replicas_in_sync(self) -> bool:
        """Whether each replica's link to its master is up (a replica that never synced
        would refuse to take over from it), and each master counts its replica online
        (only then does ``WAIT`` count it: after its first acknowledgement)."""
        roles = [self.cli(port, "INFO", "replication") for port in self.ports]
        replicas = [role for role in roles if "role:slave" in role]
        masters = [role for role in roles if "role:master" in role]
        return (
            len(replicas) == MASTERS
            and all("master_link_status:up" in replica for replica in replicas)
            and all("state=online" in master for master in masters)
        )

    def master_of(self, key: str) -> int | None:
        """The port of the master that serves ``key``'s slot now (``None``: none does,
        as between a master's failure and its replica's promotion)."""
        slot = int(self.cli(self._a_live_port(), "CLUSTER", "KEYSLOT", key))
        for node in self._nodes_seen():
            if "master" in node[2] and "fail" not in node[2]:
                for served in node[8:]:
                    first, _, last = served.partition("-")
                    if int(first) <= slot <= int(last or first):
                        return _port(node[1])
        return None

    def replica_of(self, master: int) -> int:
        """The port of ``master``'s replica."""
        nodes = self._nodes_seen()
        (master_id,) = [node[0] for node in nodes if _port(node[1]) == master]
        (replica,) = [node[1] for node in nodes if node[3] == master_id]
        return _port(replica)

    def _nodes_seen(self) -> list[list[str]]:
        """``CLUSTER NODES`` of a live node, each line split into its fields."""
        lines = self.cli(self._a_live_port(), "CLUSTER", "NODES").splitlines()
        return [line.split() for line in lines]

    def _a_live_port(self) -> int:
        return next(
            port for port, node in zip(self.ports, self._nodes, strict=True) if node.poll() is None
        )

    def kill(self, port: int) -> None:
        """SIGKILL the node at ``port``: gone, with whatever it had not replicated."""
        node = self._nodes[self.ports.index(port)]
        node.kill()
        node.wait(10)

    def stop(self) -> None:
        for node in self._nodes:
            node.kill()
            node.wait(10)
        shutil.rmtree(self._home, ignore_errors=True)


class NodeExited(AssertionError):
    """A node of a private cluster exited as it started."""


def channels_at(client: Any, pattern: str) -> dict[str, list[bytes]]:
    """The channels matching ``pattern`` that each server has subscribers to: the one
    server, or on a cluster each master (``PUBSUB CHANNELS`` counts only a node's own)."""
    return {where: server.pubsub_channels(pattern) for where, server in servers(client).items()}


def _port(address: str) -> int:
    """The port of a ``CLUSTER NODES`` address, ``host:port@bus-port``."""
    return int(address.split(":")[1].split("@")[0])


def main() -> int:
    if not shutil.which("redis-server"):
        print("redis-server is needed (make setup installs it)", file=sys.stderr)
        return 2
    cluster = PrivateRedisCluster()
    try:
        env = {**os.environ, "DJLOCKS_REDIS_CLUSTER": cluster.url}
        return subprocess.run(sys.argv[1:], env=env).returncode
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
