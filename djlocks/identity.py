"""Who is asking: the identity recorded with every grant and waiter."""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    """Host, pid, thread and free-text label of a holder or waiter.

    ``thread`` is the thread's name and its operating-system id, ``"MainThread
    (tid 4242)"``: names need not be unique, ids are among live threads (the
    session backends find deadlocks between threads by it).
    """

    host: str
    pid: int
    thread: str
    label: str


def current_identity(label: str | None) -> Identity:
    """Describe the calling thread; the label defaults to the process's command line."""
    return Identity(
        host=socket.gethostname()[:255],
        pid=os.getpid(),
        thread=f"{threading.current_thread().name[:80]} (tid {threading.get_native_id()})",
        label=(label if label is not None else " ".join(sys.argv))[:255],
    )
