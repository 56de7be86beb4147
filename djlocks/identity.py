"""Who is asking: the identity recorded with every grant and waiter."""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    """Host, pid, thread and free-text label of a holder or waiter."""

    host: str
    pid: int
    thread: str
    label: str


def current_identity(label: str | None) -> Identity:
    """Describe the calling thread; the label defaults to the process's command line."""
    return Identity(
        host=socket.gethostname()[:255],
        pid=os.getpid(),
        thread=threading.current_thread().name[:100],
        label=(label if label is not None else " ".join(sys.argv))[:255],
    )
