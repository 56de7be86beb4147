"""The names a process wrote to its store lately, and when to write them again.

A process creates a name's rows (or records the name) once, not at every grant.
``djlocks sweep`` may later remove a name that stayed idle
(``LockBackend.sweep(idle_names=...)``), so a process forgets what it wrote
after ``RECHECK`` seconds and writes it again: a name it uses keeps its rows.
The sweep refuses idle times shorter than ``SHORTEST_IDLE``, so a name that a
process has just written (and then took, or waits for) is never removed under it.
"""

from __future__ import annotations

from djlocks.recent import Recent

#: Seconds a process trusts that a name it wrote is still in the store.
RECHECK = 60.0
#: The shortest idle time, in seconds, after which a sweep may remove a name.
SHORTEST_IDLE = 2 * RECHECK


class WrittenNames(Recent):
    """Names (any hashable: a name and limit, a key) written to the store in the last
    ``RECHECK`` seconds; ``discard`` one the store no longer has."""

    def __init__(self) -> None:
        super().__init__(RECHECK)
