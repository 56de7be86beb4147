"""Fault tools for the tests: a TCP proxy in front of a real server.

The proxy forwards bytes both ways; a test can then delay the server's
replies or swallow them (the request still reaches the server and is
applied: the reply is what gets lost), cut every connection, and heal it again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    """Listens on a free port of 127.0.0.1 and forwards each connection to ``target``."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.reply_delay = 0.0  # seconds each chunk of a reply is held back
        self.drop_replies = False  # swallow the server's replies
        #: Start swallowing replies once a request containing these bytes goes by.
        self.drop_replies_from: bytes | None = None
        #: Set once a request containing ``drop_replies_from`` has gone by.
        self.dropping = threading.Event()
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
                marker = self.drop_replies_from
                if not replies and marker is not None and marker in data:
                    self.drop_replies = True
                    self.dropping.set()
                if replies and self.drop_replies:
                    continue
                if replies and self.reply_delay:
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

    def heal(self) -> None:
        self.reply_delay = 0.0
        self.drop_replies = False
        self.drop_replies_from = None
        self.dropping.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()
