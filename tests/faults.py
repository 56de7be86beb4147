"""Fault tools for the tests: a TCP proxy in front of a real server, a
private PgBouncer, and private MariaDB and PostgreSQL servers started with the
options a test needs, which a test may kill and start again.

The proxy forwards bytes both ways; a test can then delay the server's
replies or swallow them (the request still reaches the server and is
applied: the reply is what gets lost), refuse marked requests (their
connection is cut before they reach the server), cut every connection, cut
its client off from the server (silently, or as an unreachable server), and
heal it again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PGBOUNCER = "/usr/sbin/pgbouncer"  # Debian's package, installed by `make setup`


class TcpProxy:
    """Listens on a free port of 127.0.0.1 and forwards each connection to ``target``."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.reply_delay = 0.0  # seconds each chunk of a reply is held back
        #: Set once a chunk of a reply is being held back by ``reply_delay``.
        self.holding_back = threading.Event()
        self.drop_replies = False  # swallow the server's replies
        #: Start swallowing replies once a request containing these bytes goes by.
        self.drop_replies_from: bytes | None = None
        #: Set once a request containing ``drop_replies_from`` has gone by.
        self.dropping = threading.Event()
        #: Cut the connection of any request containing these bytes, which never
        #: reaches the server: to its client the server is down for that request.
        self.refuse: bytes | None = None
        #: A silent partition: nothing gets through either way, and no end hears of it.
        self.silent = False
        #: An unreachable server: each new connection is closed at once.
        self.refuse_connections = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._guard = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                if self.refuse_connections:
                    client.close()
                    continue
                if self.silent:  # held open, and never answered
                    with self._guard:
                        self._sockets.append(client)
                    continue
                server = socket.create_connection(self.target)
            except OSError:
                return
            with self._guard:
                self._sockets += [client, server]
            for source, sink, replies in ((client, server, False), (server, client, True)):
                threading.Thread(
                    target=self._pump, args=(source, sink, replies), name="proxy-pump", daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not replies and self.refuse is not None and self.refuse in data:
                    break
                marker = self.drop_replies_from
                if not replies and marker is not None and marker in data:
                    self.drop_replies = True
                    self.dropping.set()
                if self.silent or (replies and self.drop_replies):
                    continue
                if replies and self.reply_delay:
                    self.holding_back.set()
                    time.sleep(self.reply_delay)
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Close every connection through the proxy now (both ends see it end)."""
        with self._guard:
            ends, self._sockets = self._sockets, []
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                end.close()

    def cut_off(self, *, silent: bool) -> None:
        """Cut the client off from the server until ``heal()``. ``silent``: every byte
        either way is swallowed and nothing is closed, as in a network partition, so
        neither end hears of it; otherwise every connection is cut now (both ends see it
        end) and new ones are refused, as with a server that cannot be reached."""
        if silent:
            self.silent = True
        else:
            self.refuse_connections = True
            self.cut()

    def heal(self) -> None:
        if self.silent:
            self.cut()  # the connections held silent were never forwarded: end them
        self.reply_delay = 0.0
        self.drop_replies = False
        self.drop_replies_from = None
        self.refuse = None
        self.silent = False
        self.refuse_connections = False
        self.dropping.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()


class PgBouncer:
    """A private PgBouncer on a free port of 127.0.0.1, in front of PostgreSQL.

    ``pool_mode`` is PgBouncer's (``session``, ``transaction``, ``statement``);
    clients log in as they would to the server (``auth_type = trust``, every
    database forwarded). PgBouncer refuses to run as root, so under root it
    is started as the ``postgres`` user (``-u``).
    """

    def __init__(self, server_port: int, user: str, pool_mode: str) -> None:
        assert os.access(PGBOUNCER, os.X_OK), "PgBouncer is needed (make setup installs it)"
        self.port = free_port()
        self._home = Path(tempfile.mkdtemp(prefix="djlocks-pgbouncer-"))
        self._home.chmod(0o777)  # the postgres user writes its log here
        (self._home / "users.txt").write_text(f'"{user}" ""\n')
        config = self._home / "pgbouncer.ini"
        config.write_text(
            f"[databases]\n* = host=127.0.0.1 port={server_port}\n"
            f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {self._home}/users.txt\n"
            f"pool_mode = {pool_mode}\nlogfile = {self._home}/pgbouncer.log\n"
            f"ignore_startup_parameters = extra_float_digits\n"
        )
        as_postgres = ["-u", "postgres"] if os.geteuid() == 0 else []
        self._process = subprocess.Popen(
            [PGBOUNCER, *as_postgres, str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _accepts(self.port):
            assert self._process.poll() is None, self.log()
            assert time.monotonic() < deadline, "PgBouncer did not start: " + self.log()
            time.sleep(0.05)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self._home / "pgbouncer.log").read_text()
        return ""

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(10)
        shutil.rmtree(self._home, ignore_errors=True)


class PrivateMariaDB:
    """A MariaDB server of the test's own on a free port of 127.0.0.1, in a new data
    directory, started with ``options`` (``mariadbd`` command-line options such as
    ``--binlog-format=STATEMENT``): for server settings the shared server must not
    take. ``root`` logs in without a password; ``databases`` are created empty.
    ``crash()`` SIGKILLs it; ``start()`` starts it again, with crash recovery.
    """

    def __init__(self, *options: str, databases: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self._home = Path(tempfile.mkdtemp(prefix="djlocks-mariadb-"))
        self._data = self._home / "data"
        self._options = options
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={self._data}", "--user=root",
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            check=True, capture_output=True,
        )  # fmt: skip
        self.start()
        for name in databases:
            self.sql(f"CREATE DATABASE `{name}`")

    def start(self) -> None:
        log = (self._home / "server.log").open("a")
        self._process = subprocess.Popen(
            ["mariadbd", "--no-defaults", "--user=root", f"--datadir={self._data}",
             f"--port={self.port}", "--bind-address=127.0.0.1", f"--socket={self._home}/sock",
             f"--pid-file={self._home}/pid", "--innodb-buffer-pool-size=16M", *self._options],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while not _accepts(self.port):
            assert self._process.poll() is None, self.log()
            assert time.monotonic() < deadline, "MariaDB did not start: " + self.log()
            time.sleep(0.05)

    def replicate(self, primary: PrivateMariaDB) -> None:
        """Make this server a replica of ``primary`` (started with ``--log-bin`` and
        another ``--server-id``), from the start of its binary log (GTID)."""
        self.sql(
            f"CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {primary.port}, "
            f"MASTER_USER = 'root', MASTER_USE_GTID = slave_pos; START SLAVE"
        )

    def crash(self) -> None:
        """SIGKILL the server: no shutdown, as in a crash of the server alone."""
        self._process.kill()
        self._process.wait(10)

    def sql(self, statement: str) -> str:
        """Run ``statement`` with the ``mariadb`` client; its output, tab-separated."""
        return subprocess.run(
            ["mariadb", "-uroot", "-h127.0.0.1", f"-P{self.port}", "-N", "-e", statement],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self._home / "server.log").read_text()
        return ""

    def running(self) -> bool:
        """Whether the server process is alive (it may still be starting)."""
        return self._process.poll() is None

    def stop(self) -> None:
        self.crash()
        shutil.rmtree(self._home, ignore_errors=True)


class PrivatePostgreSQL:
    """A PostgreSQL cluster of the test's own (``initdb``, then ``postgres``) on a free
    port of 127.0.0.1, run as the ``postgres`` user, trust authentication, with
    ``databases`` created empty. ``crash()`` SIGKILLs the postmaster and every
    server process; ``start()`` starts it again, with crash recovery. With
    ``standby_of``, a hot standby that streams that cluster's WAL (``pg_basebackup
    -R``) instead of a new cluster.
    """

    def __init__(
        self, databases: tuple[str, ...] = (), standby_of: PrivatePostgreSQL | None = None
    ) -> None:
        import pwd

        (self._bin,) = sorted(
            Path("/usr/lib/postgresql").glob("*/bin"), key=lambda path: int(path.parent.name)
        )[-1:]
        account = pwd.getpwnam("postgres")
        self._ids = (account.pw_uid, account.pw_gid)
        self.port = free_port()
        self._home = Path(tempfile.mkdtemp(prefix="djlocks-postgresql-"))
        os.chown(self._home, *self._ids)
        self._data = self._home / "data"
        create: list[str | Path] = [self._bin / "initdb", "-A", "trust"]
        if standby_of is not None:  # a copy of the primary, set to stream its WAL (-R)
            create = [self._bin / "pg_basebackup", "-h", "127.0.0.1", "-p", str(standby_of.port),
                      "-R", "-X", "stream", "--checkpoint=fast"]  # fmt: skip
        create += ["-D", self._data, "-U", "postgres", "--no-sync"]
        subprocess.run(create, check=True, capture_output=True, preexec_fn=self._as_postgres)
        self._process: subprocess.Popen[bytes] | None = None
        self.start()
        for name in databases:
            self.sql(f'CREATE DATABASE "{name}"')

    def _as_postgres(self) -> None:
        os.setgid(self._ids[1])
        os.setuid(self._ids[0])

    def start(self) -> None:
        log = (self._home / "server.log").open("a")
        self._process = subprocess.Popen(
            [self._bin / "postgres", "-D", self._data, "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self._home}",
             "-c", "max_connections=60"],
            stdout=log, stderr=log, preexec_fn=self._as_postgres,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while not self._ready():
            assert self._process.poll() is None, self.log()
            assert time.monotonic() < deadline, "PostgreSQL did not start: " + self.log()
            time.sleep(0.1)

    def _ready(self) -> bool:
        ready = subprocess.run(
            [self._bin / "pg_isready", "-h", "127.0.0.1", "-p", str(self.port)],
            capture_output=True,
        )
        return ready.returncode == 0

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run ``statement`` with ``psql``; its output, unaligned and tuples only."""
        return subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database,
             "-Atc", statement],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip

    def crash(self) -> None:
        """SIGKILL every server process: no shutdown checkpoint, no WAL flush, as in a
        crash of the server alone (the OS keeps what it was given). The postmaster is
        stopped first, so it forks nothing while its children are killed (each is in a
        process group of its own), then killed; the lock file stays, as after a crash."""
        assert self._process is not None
        os.kill(self._process.pid, signal.SIGSTOP)
        children = [
            int(pid)
            for pid in subprocess.run(
                ["pgrep", "-P", str(self._process.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._process.kill()
        self._process.wait(10)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in children):
            assert time.monotonic() < deadline, "a server process outlived SIGKILL"
            time.sleep(0.02)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self._home / "server.log").read_text()
        return ""

    def running(self) -> bool:
        """Whether the postmaster is alive (it may still be starting)."""
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self.running():
            self.crash()
        shutil.rmtree(self._home, ignore_errors=True)


def until(done: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Wait until ``done()`` is true, for at most ``timeout`` seconds (then fail, naming
    ``what`` was awaited)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return int(probe.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` free ports, all different: each is held until all are chosen (one at a
    time, the system may hand out a port it just gave)."""
    with contextlib.ExitStack() as held:
        probes = [held.enter_context(socket.create_server(("127.0.0.1", 0))) for _ in range(count)]
        return [int(probe.getsockname()[1]) for probe in probes]


def wait_for_http(url: str, timeout: float = 60) -> None:
    """Until ``url`` answers (any status): a server that is starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.2)


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive (a zombie, dead but not yet reaped, is not)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:3]
    except OSError:
        return False


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


class Interrupted(Exception):
    """What ``interrupted_after``'s signal handler raises."""


@contextlib.contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """Expect the block, run in the main thread, to be ended after ``seconds`` by a
    signal whose handler raises (as Ctrl-C's ``KeyboardInterrupt`` does): it must raise
    ``Interrupted`` within 5 s. The handler and the timer are restored afterwards."""

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    began = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        with pytest.raises(Interrupted):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - began < 5, "the wait went on long after the signal"
