"""A private Redis Cluster on loopback for a test run: ``python -m tests.redis_cluster
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
import time
from pathlib import Path

from tests.faults import free_port

MASTERS = 3


class PrivateRedisCluster:
    """``MASTERS`` masters with one replica each, in a directory of their own."""

    def __init__(self) -> None:
        self._home = Path(tempfile.mkdtemp(prefix="djlocks-redis-cluster-"))
        self.ports = [free_port() for _ in range(2 * MASTERS)]
        self._nodes: list[subprocess.Popen[bytes]] = []
        for port in self.ports:
            directory = self._home / str(port)
            directory.mkdir()
            self._nodes.append(
                subprocess.Popen(self._command(port, directory), stdout=subprocess.DEVNULL)
            )
        for port in self.ports:
            self._until(lambda port=port: self.cli(port, "PING") == "PONG", "a node to start")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True,
        )  # fmt: skip
        self._until(self._serves_every_slot, "the cluster to serve every slot")

    @staticmethod
    def _command(port: int, directory: Path) -> list[str]:
        return [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
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

    def _until(self, done: object, what: str) -> None:
        deadline = time.monotonic() + 60
        while not done():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self._nodes:
            node.kill()
            node.wait(10)
        shutil.rmtree(self._home, ignore_errors=True)


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
