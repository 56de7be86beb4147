"""Renewals where threads are green: gevent's and eventlet's monkey-patching.

Patched, ``threading`` makes djlocks' heartbeat a greenlet, not a thread: it
renews only while the code that holds the lock yields to the hub (network I/O,
``time.sleep``, a patched lock). A holder that computes, or runs a C call that
never yields (a driver that is not cooperative, a regular expression, a
library's C loop), for longer than a third of its TTL is renewed late or not at
all, and learns it as ``LockLost`` at its next check or release. Real threads
have no such limit: the interpreter switches to the heartbeat every few
milliseconds, except during a C call that keeps the GIL.

The first heartbeat of a process warns of it once (``green_threads_warning``).
"""

from __future__ import annotations

import sys


def green_threads() -> str | None:
    """``"gevent"`` or ``"eventlet"`` when that library has patched ``threading``; else
    ``None``."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


def green_threads_warning() -> str | None:
    """The warning for this process, if its threads are green (see the module)."""
    library = green_threads()
    if library is None:
        return None
    return (
        f"djlocks: {library} has patched threading, so lease renewals run as a greenlet "
        f"and only while the holder yields to the hub. Code that holds a lock and computes "
        f"or calls C code without yielding for longer than ttl/3 loses its lease (LockLost). "
        f"Give such work a longer ttl, or run it off the hub ({library}'s thread pool)."
    )
