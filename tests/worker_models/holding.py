"""Hold a lock with a short TTL while doing some work; report what the heartbeat did."""

from __future__ import annotations

import ctypes
import time
from datetime import datetime
from typing import Any

from djlocks import Lock, LockLost

#: libc through ``PyDLL``: its calls keep the GIL (``CDLL`` would release it), as a
#: long C call of a library that never releases it does.
GIL_KEEPING_LIBC = ctypes.PyDLL(None)


def work(kind: str, seconds: float) -> None:
    """``sleep``: wait, yielding (releases the GIL; yields to gevent's hub);
    ``spin``: compute in Python (the interpreter still switches threads);
    ``c-call``: one C call that keeps the GIL for ``seconds``."""
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "spin":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass
    elif kind == "c-call":
        GIL_KEEPING_LIBC.usleep(ctypes.c_uint(round(seconds * 1_000_000)))
    else:
        raise ValueError(f"no such work: {kind!r}")


def hold(name: str, ttl: float, seconds: float, kind: str) -> dict[str, Any]:
    """Hold ``name`` (TTL ``ttl`` seconds) for ``seconds`` of ``kind`` work; return the
    fence, whether the lease's expiry moved on (renewed) and the loss, if any."""
    fence = None
    try:
        with Lock(name, ttl=ttl, timeout=30) as grant:
            fence, first_expiry = grant.fence, grant.expires_at
            work(kind, seconds)
            renewed = later(grant.expires_at, first_expiry)
    except LockLost as lost:
        return {"fence": fence, "renewed": False, "lost": str(lost)}
    return {"fence": fence, "renewed": renewed, "lost": None}


def later(moment: datetime | None, than: datetime | None) -> bool:
    """Whether the lease's expiry ``moment`` is later than it was (``than``)."""
    return moment is not None and than is not None and moment > than
